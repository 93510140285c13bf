"""Pipeline schedules: builders, validation, CSV/str I/O (pure Python), and reordering.

``build_schedule(kind, num_stages, num_microbatches, ...)`` emits a
``dynmb.types.Schedule``; ``validate`` checks it; ``to_csv``/``from_csv`` speak
torch.distributed.pipelining's compute-only CSV. Reordering lives in
``dynmb.schedule.reorder`` (``reorder``, ``REORDER_METHODS``) and is *not*
imported here: it uses ``dynmb.simulate``, which imports this package.
"""

from __future__ import annotations

from dynmb.schedule.builders import (SCHEDULE_KINDS, build_schedule, gpipe, interleaved, memory_aware,
                                     memory_windows, one_f_one_b)
from dynmb.schedule.io import from_csv, from_str, to_csv, to_str
from dynmb.schedule.validate import ScheduleError, execution_order, format_grid, validate

__all__ = ["SCHEDULE_KINDS", "build_schedule", "gpipe", "one_f_one_b", "interleaved", "memory_aware",
           "memory_windows", "validate", "ScheduleError", "execution_order", "format_grid",
           "to_csv", "from_csv", "to_str", "from_str"]

