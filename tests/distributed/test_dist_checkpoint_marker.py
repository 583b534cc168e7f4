"""A hand-edited completion marker is refused as malformed, naming the field, before any field is used.

Found by a probe: ``"files"`` as a list raised AttributeError ('list' object has no attribute 'items')
and ``"layout": "abc"`` a ValueError (invalid literal for int()), from inside the loader.
"""

from __future__ import annotations

import json
import shutil

import pytest

from ckpt_state import build, train
from mixprec.distributed import CheckpointError, load_checkpoint, save_checkpoint
from mixprec.distributed import checkpoint_layout as layout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck") / "ckpt"
    mp, model, opt = build()
    train(mp, model, opt, 2)
    save_checkpoint(root, model=model, optimizer=opt, mp=mp)
    return root


EDITS = [
    ("files a list", {"files": [".metadata"]}, r"'files' must map each file's name to its size and CRC-32, got a list"),
    ("layout a string", {"layout": "abc"}, r"'layout' must be an integer >= 0, got 'abc'"),
    ("step a float", {"step": 2.5}, r"'step' must be an integer >= 0"),
    ("a file's entry damaged", {"files": {".metadata": 12}}, r"the entry of file '.metadata' must be"),
    ("a size a string", {"files": {".metadata": {"bytes": "12", "crc32": "00000000"}}}, r"the entry of file"),
    ("save_id a number", {"save_id": 7}, r"'save_id' must be a string"),
]


@pytest.mark.parametrize("why, edit, message", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_marker_is_refused_as_malformed(saved, tmp_path, why, edit, message):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    step = root / (root / "latest").read_text().strip()
    marker = json.loads((step / layout.MARKER).read_text())
    marker.update(edit)
    (step / layout.MARKER).write_text(json.dumps(marker))
    mp, model, opt = build(seed=3)
    before = mp.state_dict()
    with pytest.raises(CheckpointError, match=rf"completion marker {layout.MARKER} is malformed \({message}") as info:
        load_checkpoint(root, model=model, optimizer=opt, mp=mp)
    assert "Load an earlier one" in str(info.value) and not isinstance(info.value.__cause__, AttributeError)
    assert mp.state_dict() == before
