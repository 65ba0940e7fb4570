"""The request inputs a diffusers-format family resolves: an image part decoded (a path or base64
data, each error naming ``inputs[i]``) and a prompt's token count before truncation."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable
from typing import Any

import torch

from omniloop.errors import RequestError
from omniloop.request import ImagePart, OmniRequest
from omniloop_io.media import read_image


def image_part(request: OmniRequest, roles: Iterable[str]) -> tuple[torch.Tensor, str] | None:
    """The first image part with one of ``roles``, decoded (uint8 ``[H, W, 3]``), and its field path
    (``inputs[i]``); None when the request has none."""
    roles = tuple(roles)
    for i, part in enumerate(request.inputs):
        if not isinstance(part, ImagePart) or part.role not in roles:
            continue
        if part.path is not None and part.data_b64 is not None:
            raise RequestError(f"inputs[{i}]", "give an image as path or data_b64, not both")
        if part.path is not None:
            return read_image(part.path, name=f"inputs[{i}].path"), f"inputs[{i}]"
        if part.data_b64 is not None:
            try:
                data = base64.b64decode(part.data_b64, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise RequestError(f"inputs[{i}].data_b64", f"is not valid base64 ({exc})") from None
            return read_image(data, name=f"inputs[{i}].data_b64"), f"inputs[{i}]"
        raise RequestError(f"inputs[{i}]", "an image part needs a path or data_b64")
    return None


def count_tokens(tokenizer: Any, text: str, *, clean: Callable[[str], str] | None = None,
                 special_tokens: bool = True) -> int:
    """Tokens a text encoder would see before truncation (``clean``: the pipeline's prompt clean-up)."""
    text = clean(text) if clean is not None else text
    ids = tokenizer(text, add_special_tokens=special_tokens, truncation=False, verbose=False)["input_ids"]
    return len(ids)


__all__ = ["count_tokens", "image_part"]
