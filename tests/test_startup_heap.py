"""engine/startup_heap.py: a serving process's start-up objects leave the collector's passes."""

from __future__ import annotations

import gc

from compiled_engine.engine.startup_heap import freeze_startup_heap


def test_freezing_moves_live_objects_out_of_collections_and_frees_garbage_first():
    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage  # a cycle: only the collector can free it
    alive = [Cycle() for _ in range(1000)]
    del garbage
    collected_before = gc.get_stats()[2]["collected"]
    try:
        frozen = freeze_startup_heap()
        # Not equal to a later get_freeze_count() in general: another thread of the test process
        # may free frozen objects in between (seen: 4 fewer).
        assert frozen >= len(alive) and gc.get_freeze_count() >= len(alive)
        assert gc.get_stats()[2]["collected"] > collected_before  # the cycle went before freezing
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in alive)  # frozen objects are not walked any more
    finally:
        gc.unfreeze()
    assert id(alive[0]) in {id(o) for o in gc.get_objects()}  # unfrozen: walked again
