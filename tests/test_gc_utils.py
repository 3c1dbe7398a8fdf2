"""freeze_gc_heap: the start-up heap leaves the collector's scans; later objects are still collected."""

from __future__ import annotations

import subprocess
import sys

# in a fresh interpreter, so that the test process's own heap stays as it is
SCRIPT = """
import gc, weakref
import slime.utils.gc_utils as g
before = gc.get_freeze_count()
class Node:
    pass
a = Node(); a.me = a  # unreachable cyclic garbage from before: the freeze's own collection frees it
ref_a = weakref.ref(a); del a
frozen = g.freeze_gc_heap("test")
b = Node(); b.me = b  # a cycle made after: a normal collection still frees it
ref_b = weakref.ref(b); del b
gc.collect()
print(before, frozen, gc.get_freeze_count(), ref_a() is None, ref_b() is None)
"""


def test_freeze_moves_the_start_up_heap_out_and_later_cycles_are_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    before, frozen, count, a_freed, b_freed = out.stdout.split()
    assert int(before) == 0 and int(frozen) == int(count) > 1000
    assert a_freed == "True" and b_freed == "True"
