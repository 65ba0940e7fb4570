"""How well the adherence detector (``omniloop_wan_demo.evaluate``) reads rendered ground truth:
the training renderer's images and clips, clean and degraded. ``python bench/adherence.py
--detector-check`` prints it. (Was ``omniloop_wan_demo.evaluate.detector_check`` until the
demos' training code moved to ``demos/``, issue 34.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omniloop_wan_demo.evaluate import ATTRIBUTES, IMAGE_ATTRIBUTES, detect, detect_image

from .render import make_clips, render_image_params, sample_image_params, to_uint8_frames

#: the degradations :func:`detector_check` scores under: (name, 3x3 box blur, noise std)
DEGRADATIONS = (("clean", False, 0.0), ("blur3+noise0.03", True, 0.03), ("noise0.05", False, 0.05))


def detector_check(n_images: int = 1000, n_clips: int = 200, seed: int = 101) -> dict[str, dict[str, float]]:
    """The detector's accuracy on rendered ground truth (:mod:`omniloop_wan_demo_training.render`), clean and
    degraded (:data:`DEGRADATIONS`): ``{"image clean": {"color": 1.0, ...}, "video ...": ...}``.
    ``python bench/adherence.py --detector-check`` prints it."""

    def degrade(x: Any, g: Any, blur: bool, noise: float) -> Any:
        if blur:
            k = torch.ones(3, 1, 3, 3) / 9.0
            x = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"), k, groups=3)
        return (x + noise * torch.randn(x.shape, generator=g)).clamp(0, 1) if noise else x

    g = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, float]] = {}
    for name, blur, noise in DEGRADATIONS:
        p = sample_image_params(n_images, seed)
        x = degrade(render_image_params(p), g, blur, noise)
        dets = [detect_image(to_uint8_frames(x[i][:, None])[0]) for i in range(n_images)]
        labels = p.labels()
        out[f"image {name}"] = {a: float(np.mean([getattr(d, a) == lab[k] for d, lab in zip(dets, labels, strict=True)]))
                                for k, a in enumerate(IMAGE_ATTRIBUTES)} | {"n": n_images}
        v, _, clip_labels = make_clips(n_clips, seed=seed + 1)
        ok = dict.fromkeys((*ATTRIBUTES, "clean"), 0)
        for i in range(n_clips):
            d = detect(to_uint8_frames(degrade(v[i].permute(1, 0, 2, 3), g, blur, noise).permute(1, 0, 2, 3)))
            for a in ATTRIBUTES:
                ok[a] += getattr(d, a) == clip_labels[i][a]
            ok["clean"] += d.ghost_frames == 0
        out[f"video {name}"] = {a: c / max(n_clips, 1) for a, c in ok.items()} | {"n": n_clips}
    return out
