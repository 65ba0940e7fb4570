"""The demo models' prompt grammar: the closed vocabulary and what each word means.

Video (``wan-demo``): ``"a {color} {shape} moving {direction}"`` (:func:`prompt_for`,
:func:`parse_prompt`, :func:`all_prompts`: 96 prompts). Image (``flux-demo``): ``"a {color} {shape}
at the {position}"`` (:func:`image_prompt_for`, :func:`parse_image_prompt`,
:func:`all_image_prompts`: 216 prompts). :data:`COLORS` are the RGB values the training data was
drawn in (the evaluator names a colour by the nearest one), :data:`POSITIONS` the object centres of
the 9 image positions, :data:`DIRECTION_VECTORS` the motion of each direction.
:func:`vocabulary_words` is what a checkpoint's ``omniloop.json`` declares as ``"vocabulary"``.

Pure Python: nothing heavy is imported. The renderer that drew the training data is the training
package's (``omniloop_wan_demo_training.render``, ``demos/wan-demo``).
"""

from __future__ import annotations

import re

__all__ = [
    "COLORS", "COLOR_NAMES", "DIRECTIONS", "DIRECTION_VECTORS", "POSITIONS", "POSITION_NAMES", "SHAPES",
    "all_image_prompts", "all_prompts", "image_prompt_for", "parse_image_prompt", "parse_prompt", "prompt_for",
    "vocabulary_words",
]

#: name -> RGB in [0, 1]. Saturated and far apart, so that color is easy to name back.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.92, 0.12, 0.10),
    "green": (0.10, 0.78, 0.20),
    "blue": (0.12, 0.28, 0.95),
    "yellow": (0.95, 0.88, 0.10),
    "cyan": (0.10, 0.85, 0.90),
    "magenta": (0.90, 0.15, 0.85),
}
#: appended in this order: a shape's index is stable (the star came last)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
#: unit motion per direction in image coordinates (x right, y down)
DIRECTION_VECTORS: dict[str, tuple[float, float]] = {
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
}
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
#: image positions, name -> (fx, fy): the object's centre as a fraction of the frame (x right, y down)
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.25, 0.25),
    "top": (0.5, 0.25),
    "top right": (0.75, 0.25),
    "left": (0.25, 0.5),
    "center": (0.5, 0.5),
    "right": (0.75, 0.5),
    "bottom left": (0.25, 0.75),
    "bottom": (0.5, 0.75),
    "bottom right": (0.75, 0.75),
}
POSITION_NAMES: tuple[str, ...] = tuple(POSITIONS)


def prompt_for(color: str, shape: str, direction: str) -> str:
    return f"a {color} {shape} moving {direction}"


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """``"a red circle moving left"`` -> ``("red", "circle", "left")``."""
    words = prompt.lower().replace(",", " ").split()
    color = next((w for w in words if w in COLORS), None)
    shape = next((w for w in words if w in SHAPES), None)
    direction = next((w for w in words if w in DIRECTIONS), None)
    if color is None or shape is None or direction is None:
        raise ValueError(f"not a demo prompt (color shape direction): {prompt!r}")
    return color, shape, direction


def all_prompts() -> list[str]:
    return [prompt_for(c, s, d) for c in COLORS for s in SHAPES for d in DIRECTIONS]


def image_prompt_for(color: str, shape: str, position: str) -> str:
    """``("red", "star", "top left")`` -> ``"a red star at the top left"``."""
    return f"a {color} {shape} at the {position}"


_VERTICAL = ("top", "bottom")
_HORIZONTAL = ("left", "right")


def parse_image_prompt(prompt: str) -> tuple[str, str, str]:
    """``"a red star at the top left"`` -> ``("red", "star", "top left")``.

    Lenient about filler words and punctuation, strict about the attributes: exactly one color,
    one shape and one position (at most one of top/bottom, one of left/right, or ``center``
    alone); anything else is a ``ValueError`` naming what is wrong."""
    if not isinstance(prompt, str):
        raise ValueError(f"an image prompt must be a string, got {type(prompt).__name__}")
    words = re.findall(r"[a-z]+", prompt.lower())
    colors = [w for w in words if w in COLORS]
    shapes = [w for w in words if w in SHAPES]
    vert = [w for w in words if w in _VERTICAL]
    horiz = [w for w in words if w in _HORIZONTAL]
    center = [w for w in words if w == "center"]
    problems = []
    if len(colors) != 1:
        problems.append(f"{'no' if not colors else 'more than one'} color (one of {', '.join(COLORS)})")
    if len(shapes) != 1:
        problems.append(f"{'no' if not shapes else 'more than one'} shape (one of {', '.join(SHAPES)})")
    if len(vert) > 1 or len(horiz) > 1 or (center and (vert or horiz or len(center) > 1)) or not (vert or horiz or center):
        problems.append(f"no single position (one of {', '.join(POSITIONS)})")
    if problems:
        raise ValueError(f"not a demo image prompt ({'; '.join(problems)}): {prompt[:120]!r}")
    position = "center" if center else " ".join(vert + horiz)
    return colors[0], shapes[0], position


def all_image_prompts() -> list[str]:
    """Every color x shape x position (6 x 4 x 9 = 216 prompts)."""
    return [image_prompt_for(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]


def vocabulary_words(kind: str = "video") -> list[str]:
    """The words the demo models' prompts are made of (sorted): what a checkpoint's
    ``omniloop.json`` declares as ``"vocabulary"`` so that ``omniloop generate`` warns about
    words the model never saw. ``kind``: ``"video"`` (wan-demo: ``a {color} {shape} moving
    {direction}``) or ``"image"`` (``a {color} {shape} at the {position}``)."""
    if kind == "video":
        words = {"a", "moving", *COLORS, *SHAPES, *DIRECTIONS}
    elif kind == "image":
        words = {"a", "at", "the", *COLORS, *SHAPES}
        for p in POSITIONS:
            words.update(p.split())
    else:
        raise ValueError(f"vocabulary kind must be 'video' or 'image', got {kind!r}")
    return sorted(words)
