"""The originals' own test files, run against the drop-ins with only their
imports changed. They are unittest classes that take no fixtures and name
no server, so the drop-ins find one through ``$POLYAK_URL``: one server for
this directory (the embedded catalog and store), named in the environment
around each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from polyak_testing import PolyakServer
from polyak_testing.backends import Backends


@pytest.fixture(scope="session")
def originals_server(
    tmp_path_factory: pytest.TempPathFactory, polyak_binary: str, backends: Backends
) -> Iterator[PolyakServer]:
    srv = backends.server(
        Backends.PAIRS[0], tmp_path_factory.mktemp("originals-data"), binary=polyak_binary
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def polyak_url(originals_server: PolyakServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("POLYAK_URL", originals_server.url)
    return originals_server.url


#: The UNet of ``hf-internal-testing/tiny-stable-diffusion-pipe`` (its
#: ``unet/config.json``), which diffusers' own ``test_ema.py`` loads from the
#: hub: built here from the same configuration, with its initial weights
#: drawn from a fixed seed, since the tests reach no hub.
TINY_SD_UNET = {
    "block_out_channels": (32, 64),
    "layers_per_block": 2,
    "sample_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "cross_attention_dim": 32,
}


@pytest.fixture(autouse=True)
def tiny_hub_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """``UNet2DConditionModel.from_pretrained`` of the hub's tiny test
    pipeline answers the same model built locally; any other path (a
    directory a test saved to) loads as diffusers loads it."""
    try:
        from diffusers import UNet2DConditionModel
    except ImportError:
        return
    import torch

    loader = UNet2DConditionModel.from_pretrained.__func__  # type: ignore[attr-defined]

    def from_pretrained(cls, path, *args, **kwargs):
        if path == "hf-internal-testing/tiny-stable-diffusion-pipe":
            torch.manual_seed(0)
            return cls(**TINY_SD_UNET)
        return loader(cls, path, *args, **kwargs)

    monkeypatch.setattr(UNet2DConditionModel, "from_pretrained", classmethod(from_pretrained))
