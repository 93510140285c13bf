"""``studies/scaling/scaling.py`` with one more ``--schedule`` setting, ``interleaved-as-1f1b``: the interleaved kind
registered again with the estimate it had before ``dynmb.timing.makespan_interleaved`` (1F1B over the chunks), so the
dynamic packer plans with it while the rows run interleaved. The A/B of studies/interleaved/notes.md "Interleaved stages
at realistic load":

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.interleaved.as_1f1b --traces sharegpt,wikitext2,longtail \
        --tokens 4M --dp 8 --sim-replicas 1 --methods dynamic --schedule interleaved-as-1f1b --stages 8,16 \
        --virtual 2 --out results/scaling_vpp_ab --no-progress
"""

from __future__ import annotations

import sys


from studies.scaling import sched as _scaling_sched
from studies.scaling import scaling
from studies.interleaved.estimate import AS_1F1B, register_as_1f1b

if __name__ == "__main__":
    register_as_1f1b()
    _scaling_sched.SCHEDULES = scaling.SCHEDULES = (*scaling.SCHEDULES, AS_1F1B)
    sys.exit(scaling.main(sys.argv[1:]))
