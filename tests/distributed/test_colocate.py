"""The phase manager's order of sleeps, wakes, weight switches, syncs and moves (the same code path as on a GPU).

Recording fakes stand in for the vLLM engine and the training engines; ``move_state=True``
makes the manager move the (fake) training state as it does on CUDA.
"""
import pytest
import torch

from fastcredit.distributed.colocate import PhaseManager


class Engine:
    """A rollout engine that records calls and which weights it holds."""

    def __init__(self, name, log):
        self.name, self.log, self.holds = name, log, None
        self.weights_version = 0  # as fastcredit.rollout.engines.base.Engine

    def sleep(self, level):
        self.log.append(f"{self.name}.sleep({level})")
        if level == 2:
            self.holds = None

    def wake_up(self, tags):
        self.log.append(f"{self.name}.wake({tags})")

    def update_weights(self, named):
        tensors = dict(named)
        self.holds = tensors["who"]
        self.log.append(f"{self.name}.load({self.holds})")


class TrainState:
    """A TrainEngine's offload / reload and its shards' device."""

    def __init__(self, log):
        self.log, self.on_device = log, True

    def offload(self):
        self.log.append("offload")
        self.on_device = False

    def reload(self):
        self.log.append("reload")
        self.on_device = True

    def full_state(self):
        assert self.on_device, "the weight sync read shards that were offloaded to the CPU"
        yield "who", "policy"


class Critic:
    def tensors(self):
        return iter([("who", "critic")])


def _manager(log, **kw):
    engine, state = Engine("engine", log), TrainState(log)
    pm = PhaseManager(engine, train_state=[state], move_state=True, sync_fn=lambda p: engine.update_weights(
        p.full_state()), **kw)
    return pm, engine, state


def test_step_order_sync_before_offload_critic_switch_in_the_same_engine():
    log = []
    pm, engine, state = _manager(log, judge_weights=Critic())
    for step in range(2):
        with pm.rollout(weights=state):
            assert engine.holds == ("policy" if step else None) and not state.on_device
        with pm.judge():
            assert engine.holds == "critic" and not state.on_device
        with pm.train():
            assert state.on_device
        pm.mark_updated()
    with pm.rollout(weights=state):
        assert engine.holds == "policy"
    first = ["offload", "engine.load(critic)", "engine.sleep(2)", "reload"]
    again = ["engine.wake(['weights'])", "engine.load(policy)", "offload", "engine.wake(['kv_cache'])",
             "engine.load(critic)", "engine.sleep(2)", "reload"]
    assert log == first + again + again[:4]
    assert set(pm.take_timings()) == {"sync_weights", "switch_to_critic", "offload", "reload", "engine_sleep",
                                      "engine_wake"}
    assert pm.take_timings() == {}
    assert [b for b, _ in pm.history][:6] == ["rollout:start", "rollout:end", "judge:start", "judge:end", "train:start",
                                             "train:end"]


def test_a_stale_engine_after_the_judge_syncs_even_when_the_state_was_offloaded():
    """A rollout right after the judge (no update between): the state comes back for the sync, then leaves."""
    log = []
    pm, engine, state = _manager(log, judge_weights=Critic())
    with pm.rollout(weights=state):
        pass
    with pm.judge():
        pass
    log.clear()
    with pm.rollout(weights=state):
        assert engine.holds == "policy"
    assert log == ["reload", "engine.load(policy)", "offload"]


def test_a_judge_with_its_own_engine_sleeps_while_the_policy_rolls_out():
    log = []
    pm = PhaseManager(Engine("policy", log), Engine("critic", log), device=torch.device("cpu"),
                      sync_fn=lambda model: log.append("sync"))
    with pm.rollout(weights=object()):
        pass
    with pm.judge():
        pass
    with pm.train():
        pass
    pm.mark_updated()
    with pm.rollout(weights=object()):
        pass
    assert log == ["critic.sleep(1)", "policy.sleep(2)", "critic.wake(None)", "critic.sleep(1)",
                   "policy.wake(['weights'])", "sync", "policy.wake(['kv_cache'])"]


def test_a_judge_that_answers_during_the_rollout_is_awake_for_it():
    """ProCeed's critic with an engine of its own answers between the policy's turns: the rollout wakes it (after the
    training state is offloaded) instead of putting it to sleep, whose HF engine would be on the host when asked."""
    log = []
    pm = PhaseManager(Engine("policy", log), Engine("critic", log), device=torch.device("cpu"),
                      sync_fn=lambda model: log.append("sync"), judge_in_rollout=True)
    with pm.train():
        pass
    pm.mark_updated()
    with pm.rollout(weights=object()):
        assert pm.awake == {"policy": True, "judge": True}
    with pm.judge():
        pass
    with pm.rollout(weights=object()):
        pass
    assert log == ["policy.sleep(2)", "critic.sleep(1)", "policy.wake(['weights'])", "sync",
                   "policy.wake(['kv_cache'])", "critic.wake(None)", "policy.sleep(2)", "policy.wake(['weights'])",
                   "sync", "policy.wake(['kv_cache'])"]  # the critic, awake since the first rollout, is left so


def test_without_colocation_engines_stay_awake_but_weights_still_sync():
    log = []
    pm = PhaseManager(Engine("policy", log), None, colocate=False, sync_fn=lambda m: log.append("sync"))
    with pm.train():
        pass
    pm.mark_updated()
    with pm.rollout(weights=object()):
        pass
    assert log == ["sync"]


def test_a_frozen_model_is_on_the_device_only_while_used():
    log = []
    pm, _, _ = _manager(log)
    ref = TrainState(log)
    ref.on_device = False
    with pm.train():
        with pm.using(ref):
            assert ref.on_device
    assert not ref.on_device and log[-2:] == ["reload", "offload"]


def test_a_kept_training_state_never_moves_but_the_cache_empties_for_the_engine(monkeypatch):
    """distributed.offload_state=false on a GPU (move_state=False): the sync reads the shards where they stay, no
    offload or reload, the reference stays too, and torch's cached blocks go back to the driver as training ends;
    the default on a GPU (move_state None) offloads. Nothing here touches CUDA: empty_cache is counted."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("fastcredit.distributed.colocate.gpu_memory", lambda device=None: {})
    gpu = torch.device("cuda", 0)
    # moved: the state out for the first rollout, back for training, the reference in and out around its pass,
    # the state out after the sync
    for move_state, moves in ((False, []), (None, ["offload", "reload", "reload", "offload", "offload"])):
        log, emptied[:] = [], []
        engine, state, ref = Engine("engine", log), TrainState(log), TrainState(log)
        pm = PhaseManager(engine, train_state=[state], device=gpu, move_state=move_state,
                          sync_fn=lambda p: engine.update_weights(p.full_state()))
        assert pm.move_state is (move_state is None)
        with pm.rollout(weights=state):
            assert engine.holds is None
        with pm.train():
            with pm.using(ref):
                assert ref.on_device
        pm.mark_updated()
        with pm.rollout(weights=state):
            assert engine.holds == "policy"
        assert [e for e in log if e in ("offload", "reload")] == moves
        assert len(emptied) == 2  # each time the rollout starts (the state left, or stayed and only the cache went)


def test_own_engine_and_switched_weights_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        PhaseManager(Engine("p", []), Engine("c", []), judge_weights=Critic())


def test_each_sync_stamps_the_policy_version_on_the_engine():
    """The engine's weights_version is the version its weights came from: set at the sync, not at the update."""
    log = []
    pm, engine, state = _manager(log, judge_weights=Critic())
    with pm.rollout(weights=state):
        assert engine.weights_version == 0
    pm.mark_updated(1)
    assert engine.weights_version == 0  # not synced yet
    with pm.judge():
        pass
    with pm.rollout(weights=state):
        assert engine.weights_version == 1
    pm.mark_updated(7)  # a resume at step 7
    with pm.rollout(weights=state):
        assert engine.weights_version == 7
    pm.mark_updated()  # None keeps the version (an engine started without weights)
    with pm.rollout(weights=state):
        assert engine.weights_version == 7
