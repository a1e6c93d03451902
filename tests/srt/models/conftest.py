"""Model tests: until srt.layers.rotary_embedding exists, install a test-only get_rope."""

import importlib.util
import pathlib
import sys
import types

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

if importlib.util.find_spec("srt.layers.rotary_embedding") is None:
    import rope_standin

    mod = types.ModuleType("srt.layers.rotary_embedding")
    mod.get_rope = rope_standin.get_rope
    sys.modules["srt.layers.rotary_embedding"] = mod
