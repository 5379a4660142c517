"""W4A16_NVFP4: NVFP4's weight tensors with unquantized activations (no input_scale)."""
from lowbit.formats.base import ACT_NONE, Tensors, register
from lowbit.formats.nvfp4 import Nvfp4


class W4A16Nvfp4(Nvfp4):
    name = "W4A16_NVFP4"
    tensors = Tensors(("weight", "weight_scale", "weight_scale_2"))
    weight_only = True
    activation = ACT_NONE
    calibration = None  # read and served; no recipe makes it

    def _quantize_input(self, x, t):
        return x


W4A16_NVFP4 = register(W4A16Nvfp4())
