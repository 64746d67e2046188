"""The head registry: what a finetuning model puts on its backbone, chosen by ``head.name``.

Each entry is a :class:`~geofm.tasks.finetuning.model.FinetuneModel` class whose ``from_config(backbone, cfg)``
builds the whole model on a timm backbone, and which declares what it takes and returns: ``inputs``,
the sample keys it is called with, and ``output``, the kind of its result (``"logits"`` (B, K),
``"dense"`` (B, K, H, W) or ``"image"`` (B, C', H*s, W*s)). A task accepts the heads whose inputs
and output are its own. Built-in heads are registered lazily, so config validation imports no
torch; a plug-in adds heads through the ``geofm.heads`` entry-point group::

    [project.entry-points."geofm.heads"]
    deeplab = "my_heads.deeplab:DeepLabSegmenter"
"""

from __future__ import annotations

from geofm.registry import Registry

HEADS: Registry = Registry("head", "geofm.heads")
"""What a finetuning model puts on its backbone (``head.name``)."""
HEADS.register("linear", "geofm.tasks.finetuning.model:Classifier")
HEADS.register("upernet", "geofm.tasks.finetuning.model:Segmenter")
HEADS.register("siamese_upernet", "geofm.tasks.finetuning.model:ChangeDetector")
HEADS.register("pixel_shuffle", "geofm.tasks.finetuning.model:SuperResolver")

__all__ = ["HEADS"]
