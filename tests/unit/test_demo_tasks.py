"""The demo's tasks (serve_rft/demo/driver.py): the letter task's reward depends on the prompt."""

import random

import pytest

from serve_rft.demo.driver import LETTER_SETS, LETTERS, letter_reward, letters_reward, task_request, vowel_reward


def test_the_letter_task_rewards_the_letter_the_prompt_asks_for():
    rng = random.Random(0)
    seen = {}
    for _ in range(50):
        prompt, reward = task_request("letter", rng)
        letter = prompt.removeprefix("Write the letter ").removesuffix(".")
        assert letter in LETTERS
        seen[letter] = reward
        assert reward(letter * 4) == 1.0 and reward("xyz") == 0.0
    assert set(seen) == set(LETTERS)
    # an answer that ignores the prompt scores at most 1 / len(LETTERS) on average over the prompts
    for answer in ("aaaa", "aeo", "ooo e"):
        assert sum(seen[x](answer) for x in LETTERS) / len(LETTERS) <= 1 / len(LETTERS) + 1e-9
    assert letter_reward("", "a") == 0.0 and letter_reward("ab", "a") == 0.5


def test_the_letters_task_rewards_any_mix_of_the_set_the_prompt_names():
    rng = random.Random(0)
    seen = {}
    for _ in range(60):
        prompt, reward = task_request("letters", rng)
        letters = tuple(prompt.removeprefix("Write with the letters ").removesuffix(".").replace(" and ", ", ")
                        .split(", "))
        assert letters in LETTER_SETS
        seen[letters] = reward
        # every mix of the set's letters is an optimum (the task keeps entropy at its optimum)
        assert reward("".join(letters)) == reward(letters[0] * 3) == reward(letters[-1] + letters[0]) == 1.0
        assert reward(" ") == 0.0
    assert set(seen) == set(LETTER_SETS)
    assert len(set().union(*LETTER_SETS)) == sum(map(len, LETTER_SETS))  # disjoint
    # an answer that ignores the prompt scores at most 1 / len(LETTER_SETS) on average over the prompts
    for answer in ("aaaa", "aot", "ouy e", "tnsaei"):
        assert sum(seen[s](answer) for s in LETTER_SETS) / len(LETTER_SETS) <= 1 / len(LETTER_SETS) + 1e-9
    assert letters_reward("", ("a",)) == 0.0 and letters_reward("ab", ("a", "e")) == 0.5


def test_the_vowel_task_and_unknown_tasks():
    prompt, reward = task_request("vowels", random.Random(1))
    assert prompt and reward is vowel_reward and reward("aeb") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="unknown demo task"):
        task_request("chess", random.Random(0))
