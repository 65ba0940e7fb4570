"""omniloop_io.media: mp4 (PyAV h264 yuv420p), png, read_image, atomic writes."""

from __future__ import annotations

import builtins
import io
from pathlib import Path

import pytest
import torch

from omniloop.errors import RequestError
from omniloop_io.media import MediaError, read_image, write_mp4, write_png

av = pytest.importorskip("av")


def frames(t: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (t, h, w, 3), generator=g, dtype=torch.uint8)


def probe(path: Path) -> tuple[int, int, int, str, str, float]:
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        decoded = list(c.decode(s))
        return (len(decoded), decoded[0].width, decoded[0].height, s.codec_context.name,
                decoded[0].format.name, float(s.average_rate))


def test_mp4_has_every_frame_at_the_right_fps(tmp_path):
    path = write_mp4(frames(9, 32, 48), 16.0, tmp_path / "out.mp4")
    assert probe(path) == (9, 48, 32, "h264", "yuv420p", 16.0)


def test_mp4_fractional_fps(tmp_path):
    path = write_mp4(frames(5, 16, 16), 23.976, tmp_path / "ntsc.mp4")
    n, *_, fps = probe(path)
    assert n == 5 and abs(fps - 23.976) < 1e-3


def test_mp4_odd_sizes_are_padded_to_even(tmp_path):
    path = write_mp4(frames(3, 33, 45), 8.0, tmp_path / "odd.mp4")
    assert probe(path)[:3] == (3, 46, 34)


def test_mp4_single_frame(tmp_path):
    assert probe(write_mp4(frames(1, 16, 16), 16, tmp_path / "one.mp4"))[0] == 1


def test_mp4_keeps_the_picture(tmp_path):
    # a flat grey video survives h264 almost unchanged
    grey = torch.full((4, 32, 32, 3), 128, dtype=torch.uint8)
    path = write_mp4(grey, 16, tmp_path / "grey.mp4")
    with av.open(str(path)) as c:
        arr = next(iter(c.decode(video=0))).to_ndarray(format="rgb24")
    assert abs(int(arr.mean()) - 128) <= 2


def test_mp4_rejects_wrong_input(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        write_mp4(torch.zeros(2, 16, 16, 3), 16, tmp_path / "x.mp4")
    with pytest.raises(ValueError, match="fps"):
        write_mp4(frames(2, 16, 16), 0, tmp_path / "x.mp4")
    assert not list(tmp_path.iterdir())


def test_write_is_atomic_on_failure(tmp_path, monkeypatch):
    dest = tmp_path / "v.mp4"
    dest.write_bytes(b"previous")

    def broken(*a, **k):
        raise RuntimeError("encoder died")

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", broken)
    with pytest.raises(RuntimeError, match="encoder died"):
        write_mp4(frames(2, 16, 16), 16, dest)
    assert dest.read_bytes() == b"previous"  # the old file is untouched, no temp file is left
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]


def test_written_files_get_normal_permissions(tmp_path):
    path = write_mp4(frames(1, 16, 16), 16, tmp_path / "p.mp4")
    assert path.stat().st_mode & 0o044  # readable by others (not mkstemp's 0600)


def test_missing_pyav_says_what_to_install(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_av(name, *a, **k):
        if name == "av":
            raise ImportError("No module named 'av'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_av)
    with pytest.raises(MediaError, match="pip install"):
        write_mp4(frames(1, 16, 16), 16, tmp_path / "x.mp4")


def test_png_round_trip_and_read_image(tmp_path):
    img = frames(1, 17, 23)[0]
    path = write_png(img, tmp_path / "a" / "img.png")  # parent folders are created
    assert torch.equal(read_image(path), img)
    assert torch.equal(read_image(path.read_bytes()), img)
    assert torch.equal(read_image(str(path)), img)


def test_png_of_a_video_writes_its_first_frame(tmp_path):
    video = frames(3, 8, 8)
    assert torch.equal(read_image(write_png(video, tmp_path / "f.png")), video[0])


def test_read_image_converts_to_rgb(tmp_path):
    from PIL import Image

    Image.new("L", (5, 4), color=200).save(tmp_path / "grey.png")
    Image.new("RGBA", (5, 4), color=(1, 2, 3, 4)).save(tmp_path / "rgba.png")
    assert read_image(tmp_path / "grey.png").shape == (4, 5, 3)
    assert read_image(tmp_path / "rgba.png")[0, 0].tolist() == [1, 2, 3]
    buf = io.BytesIO()
    Image.new("RGB", (3, 3), color=(9, 8, 7)).save(buf, format="JPEG", quality=100)
    assert read_image(buf.getvalue()).shape == (3, 3, 3)


def test_read_image_errors_name_the_input(tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"nope")
    with pytest.raises(RequestError) as info:
        read_image(bad, name="inputs[1].path")
    assert info.value.path == "inputs[1].path" and "could not be decoded" in info.value.message
    with pytest.raises(RequestError, match=r"inputs\[0\]\.data_b64: image data could not be decoded"):
        read_image(b"\x00\x01", name="inputs[0].data_b64")
    with pytest.raises(RequestError, match="does not exist"):
        read_image(tmp_path / "none.png")
