"""Write sites: steering, ablation and activation patching at the sites of the vocabulary.

A hook spec's ``interventions:`` entries (``docs/interventions.md``) are resolved here against the
architecture spec and the model config (:func:`plan_interventions`, before anything is patched or
written), then held as device buffers (:class:`Interventions`) that the patched site call reads on
every forward:

* **values** (the steering vector, the mean, the replacement table, the scale, the clamp bounds)
  live in a few tensors per run (:class:`~.device.Buffers`: each intervention a row or an offset)
  allocated at load and updated in place (:meth:`Interventions.set`), so a CUDA graph or a
  compiled graph that read them keeps reading the new values: no re-capture, no recompile;
* **which rows** an intervention touches is a per-row bool mask (and, for replacement tables, a
  per-row index) the host writes before each step from the step's rows: their requests and
  positions (:meth:`Interventions.begin_step`). In traced code a disabled intervention is a mask
  of zeros, not a Python branch: the graph is the same whether it is on or off (eager code skips
  it);
* **applying** is plain torch ops (``torch.where(mask, f(x), x)``), traced into compiled graphs
  like the model's own; rows outside the mask keep their bits.

Order with a capture of the same site: the capture sees the value after the interventions
(``capture: after``, the default) or before them (``capture: before``), per site.

Modules: :mod:`.plan` (entries resolved and checked; client values), :mod:`.device` (device
buffers, per-step masks, the site call), :mod:`.patching` (replacement tables from a store).
"""
from .device import DEFAULT_ROWS, ROW_DIMS, Buffers, Intervention, Interventions, WriteSite, full_layout
from .patching import values_from_store
from .plan import (KINDS, TAKES, InterventionError, InterventionPlan, client_values, fit_value, plan_interventions,
                   write_problem)

__all__ = ["DEFAULT_ROWS", "KINDS", "ROW_DIMS", "TAKES", "Buffers", "Intervention", "InterventionError", "InterventionPlan",
           "Interventions", "WriteSite", "client_values", "fit_value", "full_layout", "plan_interventions",
           "values_from_store", "write_problem"]
