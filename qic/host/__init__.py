"""Host-side glue shared by the build and the runtime: schedule, noise, packing, prompt template.

Small, pure functions over torch/numpy: no model definitions, no compiler. The runtime imports these.
"""
