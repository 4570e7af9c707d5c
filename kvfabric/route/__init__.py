"""``kvfabric route``: send each request to the vLLM instance where its KV is cheapest (docs/route.md).

* :mod:`.events`: vLLM's KV events -> per-instance prefix residency in kvfabric keys;
* :mod:`.pool`: the pool's residency of a prompt (LOOKUP of the vLLM connector's keys, or the pool's KV events);
* :mod:`.cost`: the predicted time to first token;
* :mod:`.fleet`: the instances, their /metrics, the choice;
* :mod:`.server`: the OpenAI-compatible HTTP front, kv and pd modes, and the CLI.
"""

from .cost import Prediction, Rate, predict
from .events import EngineIndex, Subscriber, decode_batch
from .fleet import Costs, Fleet, Instance

__all__ = ["Costs", "EngineIndex", "Fleet", "Instance", "Prediction", "Rate", "Subscriber", "decode_batch",
           "predict"]
