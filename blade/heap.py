"""``frozen_heap()``: Python's cyclic garbage collector skips the objects that exist on entry.

dynamo's capture with symbolic sizes allocates many short-lived objects (sympy expressions, SymNodes),
and each full collection it triggers walks every object of the process (torch, sympy, the model): a
quarter of a dynamic capture's CPU time on BERT. ``gc.freeze`` moves the objects alive on entry into
the permanent generation, so collections walk only what the capture allocates; on exit they are
collectable again. Garbage is still collected (young objects as usual, the old ones after exit), so
nothing but the timing of collections changes. A process that froze objects itself (a pre-fork
server) is left as it is: its frozen objects stay frozen.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0          # frozen_heap()s open in this process (threads included)
_ours = False       # whether the outermost one froze (nothing was frozen before it)


@contextlib.contextmanager
def frozen_heap():
    global _depth, _ours
    with _lock:
        if _depth == 0:
            _ours = gc.get_freeze_count() == 0
            if _ours:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _ours:
                gc.unfreeze()
