"""plan_chunks' count-only fast path (no sizes) gives the general loop's answer."""

from __future__ import annotations

import random

from kvfabric._plan import plan_chunks


def test_count_only_path_matches_the_general_loop():
    rng = random.Random(5)
    for _ in range(300):
        idx = sorted(rng.sample(range(5000), rng.randint(0, 700)))
        max_keys = rng.choice([1, 2, 7, 64, 500, 4096])
        max_payload = rng.choice([0, 1, 1 << 20])
        want = plan_chunks(idx, max_keys, max_payload, lambda i: 0)  # the loop, every key weighing 0
        assert plan_chunks(idx, max_keys, max_payload) == want
        assert plan_chunks(tuple(idx), max_keys, max_payload) == want
        assert plan_chunks(iter(idx), max_keys, max_payload) == want
