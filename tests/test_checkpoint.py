"""Atomic, verified checkpoints: round trip of model, optimizer, RNG and trainer state; the manifest; pruning; a
half-written step is ignored; every kind of damage is named by file and the resume falls back to the earlier
checkpoint (with and without a manifest); a broken ``latest``."""
import hashlib
import json
import os
import random

import pytest
import torch

from fastcredit.distributed.checkpoint import (MANIFEST, CheckpointError, checkpoint_candidates, latest_checkpoint,
                                   load_checkpoint, resume_checkpoint, save_checkpoint, verify_checkpoint)


def _model_and_opt(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_round_trip_restores_everything(tmp_path):
    m, opt = _model_and_opt(0)
    random.seed(5)
    save_checkpoint(str(tmp_path), 7, {"policy": m}, {"policy": opt}, {"data": {"epoch": 1, "cursor": 3}})
    expected = (random.random(), torch.rand(2))
    m2 = _model_and_opt(1)[0]  # stale gradients, and an optimizer that never stepped
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    state = load_checkpoint(latest_checkpoint(str(tmp_path)), {"policy": m2}, {"policy": opt2})
    assert state == {"step": 7, "data": {"epoch": 1, "cursor": 3}}
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(s1["exp_avg"], s2["exp_avg"]) and torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])
    assert random.random() == expected[0] and torch.equal(torch.rand(2), expected[1])


def test_keeps_the_newest_and_ignores_unfinished(tmp_path):
    m, opt = _model_and_opt(0)
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, {"policy": m}, {"policy": opt}, {}, keep=2)
    os.makedirs(tmp_path / "step_000004.tmp")  # a crash mid-write
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002", "step_000003", "step_000004.tmp"]
    assert latest_checkpoint(str(tmp_path)).endswith("step_000003")


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    """A run that fell back to step 1 saves step 2 again: the later step 3 (an abandoned timeline) goes, the new
    step 2 and, with keep=2, step 1 stay; keep=1 leaves the new one alone."""
    m, opt = _model_and_opt(0)
    for step in (1, 2, 3, 2):
        save_checkpoint(str(tmp_path), step, {"policy": m}, {"policy": opt}, {}, keep=3 if step == 3 else 2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000002"]
    save_checkpoint(str(tmp_path), 2, {"policy": m}, {"policy": opt}, {}, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002"]
    assert verify_checkpoint(str(tmp_path / "step_000002")) == []


def test_missing_checkpoint_is_named(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest").write_text("step_000009\n")
    with pytest.raises(FileNotFoundError, match="step_000009"):
        latest_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("")
    with pytest.raises(CheckpointError, match="latest is empty"):
        latest_checkpoint(str(tmp_path))


class _SelfSavingEngine:
    """An engine that writes its own state (as DeepSpeed does), here one tensor per folder."""

    def __init__(self, value):
        self.w = torch.tensor([value])

    def save_state(self, folder):
        os.makedirs(folder)
        torch.save(self.w, os.path.join(folder, "w.pt"))

    def load_state(self, folder):
        self.w = torch.load(os.path.join(folder, "w.pt"))


def test_engines_that_save_themselves_get_their_own_folders(tmp_path):
    engines = {"policy": _SelfSavingEngine(1.0), "value": _SelfSavingEngine(2.0)}
    path = save_checkpoint(str(tmp_path), 3, {}, {}, {"opt_steps": 6}, engines=engines)
    assert latest_checkpoint(str(tmp_path)) == path and path.endswith("step_000003")
    assert sorted(os.listdir(path)) == ["engine", MANIFEST, "rng_rank0.pt", "trainer.json"]  # no DCP folder
    fresh = {"policy": _SelfSavingEngine(0.0), "value": _SelfSavingEngine(0.0)}
    assert load_checkpoint(path, {}, {}, engines=fresh) == {"step": 3, "opt_steps": 6}
    assert [float(e.w) for e in fresh.values()] == [1.0, 2.0]
    m, opt = _model_and_opt(0)
    with pytest.raises(FileNotFoundError, match="no model/ .*another distributed.engine"):
        load_checkpoint(path, {"policy": m}, {"policy": opt})
    with pytest.raises(FileNotFoundError, match="no engine/critic"):
        load_checkpoint(path, {}, {}, engines={"critic": _SelfSavingEngine(0.0)})


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    m, opt = _model_and_opt(0)
    path = save_checkpoint(str(tmp_path), 4, {"policy": m}, {"policy": opt}, {},
                           engines={"value": _SelfSavingEngine(1.0)})
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    assert {k: manifest[k] for k in ("format", "step", "world_size", "hash")} == \
        {"format": 1, "step": 4, "world_size": 1, "hash": "sha256"}
    on_disk = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    assert sorted(manifest["files"]) == [f for f in on_disk if f != MANIFEST] == \
        ["engine/value/w.pt", "model/.metadata", "model/__0_0.distcp", "rng_rank0.pt", "trainer.json"]
    for rel, entry in manifest["files"].items():
        data = open(os.path.join(path, rel), "rb").read()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(path, rank=0) == []


def _two_checkpoints(root):
    """Steps 1 and 2 with different weights; returns step 1's weights."""
    m, opt = _model_and_opt(0)
    save_checkpoint(root, 1, {"policy": m}, {"policy": opt}, {"data": {"cursor": 1}}, keep=3)
    first = [p.detach().clone() for p in m.parameters()]
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    save_checkpoint(root, 2, {"policy": m}, {"policy": opt}, {"data": {"cursor": 2}}, keep=3)
    return first


def _truncate(f):
    os.truncate(f, os.path.getsize(f) // 2)


def _overwrite_4k(f):
    """4 KiB of 0xff inside the file, its size unchanged (0xff bytes read as float32 are NaN)."""
    size = os.path.getsize(f)
    with open(f, "r+b") as h:
        h.seek(size // 2 - 2048)
        h.write(b"\xff" * 4096)
    assert os.path.getsize(f) == size


DAMAGE = {  # id: (file under step_000002, what is done to it)
    "trainer.json-truncated": ("trainer.json", _truncate),
    "rng-truncated": ("rng_rank0.pt", _truncate),
    "rng-deleted": ("rng_rank0.pt", os.remove),
    "shard-truncated": ("model/__0_0.distcp", _truncate),
    "metadata-truncated": ("model/.metadata", _truncate),
    "shard-overwritten-4KiB": ("model/__0_0.distcp", _overwrite_4k),
}
MESSAGE = {  # with a manifest / without one (the damage found while loading, where nothing else can tell)
    True: {"rng-deleted": "missing (listed in manifest.json)", "shard-overwritten-4KiB": "contents differ from "
           "manifest.json (same size"},
    False: {"trainer.json-truncated": "unreadable (JSONDecodeError", "rng-truncated": "unreadable (OSError",
            "rng-deleted": "missing", "shard-truncated": "truncated", "metadata-truncated": "unreadable",
            "shard-overwritten-4KiB": "(DCP): rank 0: RuntimeError: PytorchStreamReader"},
}


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_earlier_one_resumed(tmp_path, damage, manifest):
    root = str(tmp_path)
    first = _two_checkpoints(root)
    rel, hurt = DAMAGE[damage]
    hurt(os.path.join(root, "step_000002", rel))
    if not manifest:  # as an older fastcredit wrote it
        os.remove(os.path.join(root, "step_000002", MANIFEST))
    m, opt = _model_and_opt(1)
    said = []
    path, state = resume_checkpoint(root, {"policy": m}, {"policy": opt}, say=said.append)
    assert path == os.path.join(root, "step_000001") and state == {"step": 1, "data": {"cursor": 1}}
    assert all(torch.equal(a, b) for a, b in zip(first, m.parameters()))
    bad = os.path.join(root, "step_000002", rel if rel != "model/__0_0.distcp" or manifest or
                       damage != "shard-overwritten-4KiB" else "model")
    lines = "\n".join(said)
    assert f"checkpoint {os.path.join(root, 'step_000002')} cannot be used:\n  {bad}" in lines, lines
    assert MESSAGE[manifest].get(damage, "bytes, manifest.json says") in lines
    assert said[-1] == f"falling back to {path}, the newest checkpoint that verifies"


def test_an_unlisted_or_garbled_manifest_file_is_damage(tmp_path):
    root = str(tmp_path)
    _two_checkpoints(root)
    extra = tmp_path / "step_000002" / "model" / "__1_0.distcp"
    extra.write_bytes(b"x")
    assert verify_checkpoint(str(tmp_path / "step_000002")) == [f"{extra}: not listed in manifest.json (added after "
                                                                 "the save)"]
    (tmp_path / "step_000001" / MANIFEST).write_text('{"files": [')
    with pytest.raises(CheckpointError, match=r"step_000002: .*__1_0.distcp: not listed[\s\S]*step_000001: .*"
                                              r"manifest.json: unreadable \(JSONDecodeError"):
        resume_checkpoint(root, {"policy": _model_and_opt(1)[0]}, {}, say=lambda s: None)


def test_without_a_checkpoint_that_verifies_the_error_lists_each(tmp_path):
    root = str(tmp_path)
    _two_checkpoints(root)
    size = os.path.getsize(tmp_path / "step_000002" / "trainer.json")
    _truncate(str(tmp_path / "step_000002" / "trainer.json"))
    os.remove(tmp_path / "step_000001" / "rng_rank0.pt")
    with pytest.raises(CheckpointError) as err:
        resume_checkpoint(root, {"policy": _model_and_opt(1)[0]}, {}, say=lambda s: None)
    assert str(err.value).splitlines() == [
        f"no checkpoint under {root} can be resumed:",
        f"  step_000002: {tmp_path}/step_000002/trainer.json: {size // 2} bytes, manifest.json says {size} "
        "(truncated or rewritten)",
        f"  step_000001: {tmp_path}/step_000001/rng_rank0.pt: missing (listed in manifest.json)"]


@pytest.mark.parametrize("latest", ["", "\x00\xff garbage", "step_000003\n", None],
                         ids=["empty", "garbage", "names-a-removed-folder", "absent"])
def test_a_broken_latest_is_named_and_the_newest_good_checkpoint_used(tmp_path, latest):
    root = str(tmp_path)
    _two_checkpoints(root)
    if latest is None:
        os.remove(tmp_path / "latest")
    else:
        (tmp_path / "latest").write_bytes(latest.encode("latin-1"))
    m = _model_and_opt(1)[0]
    said = []
    path, state = resume_checkpoint(root, {"policy": m}, {}, say=said.append)
    assert path.endswith("step_000002") and state["step"] == 2
    what = {"": "is empty", "\x00\xff garbage": "holds '\\x00\ufffd garbage', not a checkpoint name (step_N)",
            "step_000003\n": f"names step_000003, which is not in {root}", None: "is missing"}[latest]
    assert said == [f"{root}/latest {what}; trying step_000002, step_000001 (newest first)",
                    f"using {path}, the newest checkpoint that verifies"]
    assert checkpoint_candidates(str(tmp_path / "nothing")) == ([], [])


def test_a_save_killed_before_latest_moved_resumes_from_what_latest_names(tmp_path):
    root = str(tmp_path)
    _two_checkpoints(root)
    (tmp_path / "latest").write_text("step_000001\n")
    said = []
    path, _ = resume_checkpoint(root, {"policy": _model_and_opt(1)[0]}, {}, say=said.append)
    assert path.endswith("step_000001") and said == []


def test_export_refuses_a_damaged_checkpoint(tmp_path):
    from fastcredit.models.export import ExportError, find_checkpoint

    _two_checkpoints(str(tmp_path / "checkpoints"))
    _overwrite_4k(str(tmp_path / "checkpoints" / "step_000002" / "model" / "__0_0.distcp"))
    with pytest.raises(ExportError, match=r"step_000002 is damaged; pass --step with another \(available: 1, 2\):"
                                          r"\n  .*step_000002/model/__0_0.distcp: contents differ from manifest"):
        find_checkpoint(str(tmp_path))
    assert find_checkpoint(str(tmp_path), step=1) == str(tmp_path / "checkpoints" / "step_000001")
