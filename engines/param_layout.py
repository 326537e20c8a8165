"""One model's parameters in either layer layout, and the moves between them.

A decoder's parameters come in two layouts (engines/layer_scan.py): per layer, each
layer under its own name "layers_0" .. "layers_{L-1}" (the unrolled loop; checkpoints
always), or stacked, every layer leaf [L, ...] under "layers" (the scan). Which one an
engine runs is decided by where it runs (`layer_scan.use_scan`), so two engines of one
model can hold their weights differently: a paged engine and a contiguous one, one device
and several, float and quantized. Parameters handed from one to the other are converted
here (`adopt`), and the engines' checkpoint view (`stored_abstract`, `from_stored`) is
per layer whatever the engine runs, so weights compare and travel through it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from engines import kv_heads, layer_scan
from engines.model import Decoder
from engines.param_loading import trace_params


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
    """Each leaf's '/'-joined path -> its shape."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in p): tuple(np.shape(x))
            for p, x in flat}


def _difference(got: dict, want: dict) -> str | None:
    """The first way `got` differs from the abstract tree `want`, or None."""
    have, need = _shapes(got), _shapes(want)
    for path, shape in need.items():
        if path not in have:
            return f"no parameter {path!r}"
        if have[path] != shape:
            return f"parameter {path!r} is {have[path]}, expected {shape}"
    extra = sorted(set(have) - set(need))
    return f"an unexpected parameter {extra[0]!r}" if extra else None


def adopt(params: dict, abstract: dict, shardings: dict, num_layers: int) -> dict:
    """`params` of the model whose parameters are `abstract` (in the layout it runs) in
    that layout, placed with `shardings`: as given where they are in it already, stacked
    or unstacked where they come per layer or stacked instead. The given arrays are kept.
    A tree in neither layout is a ValueError saying what was expected."""
    if _difference(params, abstract) is None:
        return params
    scanned = "layers" in abstract
    other = (jax.eval_shape(layer_scan.unstack_layers, abstract) if scanned else
             jax.eval_shape(lambda p: layer_scan.stack_layers_as(p, num_layers), abstract))
    why = _difference(params, other)
    if why is not None:
        runs = "stacked under 'layers' [L, ...]" if scanned else "per layer"
        raise ValueError(
            f"params fit neither layer layout of this model ({num_layers} layers, which "
            f"this engine runs {runs}): expected 'layers_0' .. 'layers_{num_layers - 1}' "
            f"(per layer) or 'layers' with a leading axis of {num_layers} (stacked), "
            f"beside {sorted(k for k in abstract if k != 'layers')} and with this "
            f"engine's shapes; in its own layout {_difference(params, abstract)}, in the "
            f"other {why}")
    if scanned:
        return layer_scan.stack_layers(params, num_layers, shardings, keep=True)
    return jax.device_put(layer_scan.unstack_layers(params), shardings)


class InLayout:
    """An engine's door for the parameters it is handed: those in its own layout pass as
    they are (one dict lookup per call); another layout's are converted by `adopt` once
    and the result reused while the same tree is handed again, so a decode loop over
    another engine's parameters converts them once, not every step. The last converted
    tree and its source are held until another one comes."""

    def __init__(self, abstract: dict, shardings: dict, num_layers: int):
        self._abstract, self._shardings, self._num_layers = abstract, shardings, num_layers
        self._scanned = "layers" in abstract
        self._last: tuple[dict, dict] | None = None

    def __call__(self, params: dict) -> dict:
        if not isinstance(params, dict) or ("layers" in params) == self._scanned:
            return params
        if self._last is None or self._last[0] is not params:
            self._last = (params, adopt(params, self._abstract, self._shardings,
                                        self._num_layers))
        return self._last[1]


def stored_abstract(model: Decoder, abstract: dict, kv_repeat: int) -> dict:
    """The shapes of `model`'s parameters (`abstract`) as a checkpoint stores them: one
    copy of each kv head, each layer under its own name, whatever the engine runs."""
    if kv_repeat == 1:
        return (jax.eval_shape(layer_scan.unstack_layers, abstract) if "layers" in abstract
                else abstract)
    stored = dataclasses.replace(kv_heads.stored_config(model.cfg, kv_repeat),
                                 scan_layers=False)
    return trace_params(Decoder(stored, dtype=model.dtype))[0]


def from_stored(stored: dict, logical: dict, kv_repeat: int, num_layers: int) -> dict:
    """A tree shaped as `stored_abstract` (numpy or jax arrays) in the engine's layout:
    stacked where its `logical` names are, each kv head repeated kv_repeat times."""
    xp = np if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(stored)) else jnp
    if "layers" in logical:
        stored = layer_scan.stack_layers_as(stored, num_layers, xp)
    return kv_heads.repeat_heads(stored, logical, kv_repeat, xp)


class ParamViews:
    """An engine's parameters seen as a checkpoint stores them and as another engine
    hands them over. Mixed into engines.TransformerEngine, whose `model`, `model_config`,
    `abstract_params`, `param_shardings`, `_logical` (the logical names) and `kv_repeat`
    it reads."""

    def checkpoint_params(self, params: dict) -> dict:
        """`params` as a checkpoint stores them (for `source_config`): one copy of each
        kv head, each layer under its own name."""
        return layer_scan.unstack_layers(
            kv_heads.select_heads(params, self._logical, self.kv_repeat))

    def params_from_checkpoint(self, stored: dict) -> dict:
        """The inverse: a tree shaped as `checkpoint_abstract()` (numpy or jax arrays)
        in this engine's layer layout, each kv head repeated as it runs them; place it
        with `param_shardings`."""
        return from_stored(stored, self._logical, self.kv_repeat, self.model_config.num_layers)

    def checkpoint_abstract(self) -> dict:
        """The shapes and dtypes of the parameters as stored (`source_config`, per layer)."""
        return stored_abstract(self.model, self.abstract_params, self.kv_repeat)

    def adopt_params(self, params: dict) -> dict:
        """Parameters of this model held by another engine in either layer layout (per
        layer or stacked; with this engine's kv heads) in this one's, placed with
        `param_shardings`. The entry points that take params do this themselves, once
        per tree handed to them."""
        return adopt(params, self.abstract_params, self.param_shardings,
                     self.model_config.num_layers)

    def kv_head_tensors(self) -> list[str]:
        """The parameters that hold one slice per kv head (engines/kv_heads.py)."""
        return kv_heads.kv_head_paths(self._logical)
