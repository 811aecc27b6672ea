"""A saved trainer state resumes training exactly: the same weights, optimizer moments, RNG and
running baseline, so the next step from the resumed trainer equals the next step of the original."""

import torch

from serve_rft.config import Config
from serve_rft.trainer.policy.policy import PolicyTrainer
from serve_rft.trainer.publishing.state import latest_state, save_state
from serve_rft.types import Experience, RewardedExperience, SamplingInfo


def _batch(k: int) -> list[RewardedExperience]:
    out = []
    for i in range(4):
        resp = [10 + i, 20 + k, 30 + i]
        out.append(RewardedExperience(
            experience=Experience(completion_id=f"c{k}", choice_index=i, group_id=f"c{k}", replica_id="r",
                                  prompt_token_ids=[1, 2, 3], response_token_ids=resp,
                                  behaviour_logprobs=[-3.0, -2.5, -4.0], token_versions=[(0, 0, 3)],
                                  sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=3),
                                  finish_reason="length"),
            reward=float(i), stream_id=f"{k}-{i}"))
    return out


def _params(p: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in p.model.named_parameters()}


def test_a_resumed_trainer_continues_exactly(tmp_path, embedded_model):
    cfg = Config()
    a = PolicyTrainer(cfg, str(embedded_model))
    a.step(_batch(0))
    a.step(_batch(1))
    trained = [(b.stream_id, b.member, 7) for b in _batch(1)]
    path = save_state(tmp_path, a.model, a.optimizer, 7, 7, a.baseline.value, trained,
                      embedded_model, keep=2)
    assert latest_state(tmp_path) == path

    b = PolicyTrainer(cfg, str(embedded_model), resume=path)
    assert (b.resumed.version, b.resumed.step, b.resumed.trained) == (7, 7, trained)
    assert b.baseline.value == a.baseline.value
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)

    a.step(_batch(2))
    b.step(_batch(2))
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa), "the step after resume differs"


def test_a_state_folder_is_a_hugging_face_model_directory(tmp_path, embedded_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = PolicyTrainer(Config(), str(embedded_model))
    path = save_state(tmp_path, p.model, p.optimizer, 1, 1, None, [], embedded_model)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert model.config.vocab_size == p.model.config.vocab_size


def test_only_the_newest_states_are_kept(tmp_path, embedded_model):
    p = PolicyTrainer(Config(), str(embedded_model))
    for v in range(1, 5):
        save_state(tmp_path, p.model, p.optimizer, v, v, None, [], None, keep=2)
    assert sorted(d.name for d in tmp_path.iterdir()) == ["v000003", "v000004"]


def test_published_floor_and_trained_lists_survive_in_the_state_root(tmp_path, embedded_model):
    from serve_rft.trainer.publishing.state import published_floor, record_published, trained_lists

    assert published_floor(tmp_path) == 0
    record_published(tmp_path, 12)
    assert published_floor(tmp_path) == 12
    p = PolicyTrainer(Config(), str(embedded_model))
    save_state(tmp_path, p.model, p.optimizer, 1, 1, None, [("1-0", "c:0", 1)], None)
    save_state(tmp_path, p.model, p.optimizer, 2, 2, None, [("2-0", "c:1", 2), ("2-1", "d:0", 2)], None)
    assert trained_lists(tmp_path) == [("1-0", "c:0", 1), ("2-0", "c:1", 2), ("2-1", "d:0", 2)]
