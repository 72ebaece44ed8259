"""``fastcredit.runtime.files``: atomic writes, the built-from stamps of generated folders, seeding."""
import os
import random
import threading

import numpy as np
import pytest
import torch

from fastcredit.runtime.files import BUILT_FROM, atomic_output, built_from, mark_built, seed_everything, wait_for_built


def test_atomic_output_keeps_the_old_file_on_failure(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(str(target)) as tmp:
            with open(tmp, "w") as fh:
                fh.write("half")
            raise RuntimeError("writer died")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]
    with atomic_output(str(target)) as tmp:
        with open(tmp, "w") as fh:
            fh.write("new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["f.txt"]
    assert os.stat(target).st_mode & 0o777 == 0o644  # shared, not mkstemp's 0600


def test_a_folder_is_built_from_exactly_what_its_stamp_says(tmp_path):
    folder, key = str(tmp_path), {"toy": {"seed": 0, "people": 3}, "vocab": 600}
    assert not built_from(folder, key)  # no stamp yet
    mark_built(folder, key)
    assert sorted(os.listdir(folder)) == [BUILT_FROM]  # no temporary left behind
    assert built_from(folder, {"vocab": 600, "toy": {"people": 3, "seed": 0}})  # key order does not matter
    assert not built_from(folder, {**key, "vocab": 601})  # another config: rebuilt, not reused
    (tmp_path / BUILT_FROM).write_text("{torn")
    assert not built_from(folder, key)  # a damaged stamp is no stamp


def test_other_ranks_wait_for_the_stamp_and_give_up_after_the_timeout(tmp_path):
    folder, key = str(tmp_path), {"vocab": 600}
    with pytest.raises(TimeoutError, match="did not build"):
        wait_for_built(folder, key, timeout_s=0.3)
    builder = threading.Timer(0.3, mark_built, (folder, key))
    builder.start()
    wait_for_built(folder, key, timeout_s=30)
    builder.join()
    assert built_from(folder, key)


def test_seed_everything_seeds_python_numpy_and_torch():
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    seed_everything(3)
    first = draws()
    seed_everything(3)
    assert draws() == first
    seed_everything(4)
    assert all(a != b for a, b in zip(draws(), first))
