"""The table for GPUs never tuned: Hopper's values, none of which needs Hopper (the routes that need Hopper
instructions check the architecture themselves). A new GPU's table starts as `dataclasses.replace(DEFAULT, ...)`
with what its measurements change."""
import dataclasses

from lowbit.kernels.tuning.sm90 import SM90

DEFAULT = dataclasses.replace(SM90)
