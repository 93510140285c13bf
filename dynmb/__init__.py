"""dynmb: dynamic microbatching for pipeline-parallel transformer training.

The loop: length traces (``dynmb.data``) -> packers (``dynmb.packing``) under a
per-GPU memory limit (``dynmb.memory``) and a fitted cost model
(``dynmb.costmodel``) -> schedules (``dynmb.schedule``) checked by a simulator
(``dynmb.simulate``) -> real torch.distributed runs (``dynmb.runtime``) -> tidy
pandas tables (``dynmb.results``) and plots (``dynmb.plots``).
"""

__version__ = "0.1.0"
