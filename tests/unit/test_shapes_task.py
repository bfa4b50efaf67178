"""The built-in visual task: what its pictures show is what its answers say, the held-out set is fixed whatever the
run's seed, training draws are reproducible per step, and its tokenizer covers every question and answer."""
import pytest
from PIL import Image

from rlcore.errors import ConfigError
from rlcore.multimodal import IMAGES
from rlcore_plugins.tasks.shapes import CELLS, COLOURS, _build


def cell_colours(image: Image.Image) -> list[str | None]:
    """Each cell's colour, read off the picture: the one non-white colour found in it, if any."""
    half = image.size[0] // 2
    found = []
    for i in range(len(CELLS)):
        box = ((i % 2) * half, (i // 2) * half, (i % 2 + 1) * half, (i // 2 + 1) * half)
        colours = {rgb for _, rgb in image.crop(box).getcolors(half * half)} - {(255, 255, 255)}
        assert len(colours) <= 1
        found.append(next(name for name, rgb in COLOURS.items() if rgb in colours) if colours else None)
    return found


@pytest.mark.parametrize("questions", ["count", "colour"])
def test_answers_are_what_the_pictures_show(questions):
    task = _build({"questions": questions, "eval_size": 50}, seed=3)
    for prompt, meta in task.eval_prompts() + task.train_prompts(0, 50):
        assert prompt.startswith("<image> ") and len(meta[IMAGES]) == 1
        cells = cell_colours(meta[IMAGES][0])
        words = prompt.split()[1:]
        if words[0] == "count":
            assert meta["answer"] == str(cells.count(words[1]))
        else:
            assert meta["answer"] == (cells[CELLS.index(" ".join(words[1:]))] or "none")


@pytest.mark.parametrize("image_size", [56, 112])
def test_group_scene_answers_count_the_squares_and_name_their_one_colour(image_size):
    task = _build({"scene": "group", "image_size": image_size, "eval_size": 100}, seed=3)
    examples = task.eval_prompts() + task.train_prompts(0, 100)
    for prompt, meta in examples:
        cells = cell_colours(meta[IMAGES][0])
        shown = [c for c in cells if c]
        assert len(set(shown)) <= 1
        expected = {"count": str(len(shown)), "colour": shown[0] if shown else "none"}[prompt.split()[1]]
        assert prompt.split()[0] == "<image>" and len(prompt.split()) == 2 and meta["answer"] == expected
    counts = [m["answer"] for p, m in examples if p.endswith("count")]
    assert set(counts) == set("01234")         # uniform 0-4: no answer the question alone gives most of the time
    assert max(counts.count(c) for c in set(counts)) < 0.4 * len(counts)


def test_held_out_set_is_fixed_and_training_draws_repeat():
    a, b = _build({}, seed=0), _build({}, seed=1)
    assert [p for p, _ in a.eval_prompts()] == [p for p, _ in b.eval_prompts()]
    assert [m["answer"] for _, m in a.eval_prompts()] == [m["answer"] for _, m in b.eval_prompts()]
    again = _build({}, seed=0)
    assert [(p, m["answer"]) for p, m in a.train_prompts(7, 20)] == \
        [(p, m["answer"]) for p, m in again.train_prompts(7, 20)]
    assert a.train_prompts(7, 20) != a.train_prompts(8, 20)
    assert all(len(e) == 3 and IMAGES in e[2] for e in a.supervised_examples(0, 4))


def test_tokenizer_covers_every_question_and_answer(tmp_path):
    from transformers import AutoTokenizer

    task = _build({}, seed=0)
    task.write_tokenizer(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenizer.eos_token_id == 0      # the word-level model reads an unknown word as the end (id 0)
    for prompt, meta in task.eval_prompts():
        words = prompt.replace("<image>", "") + " " + meta["answer"]
        ids = tokenizer.encode(words, add_special_tokens=False)
        assert 0 not in ids and len(ids) == len(words.split())


@pytest.mark.parametrize("options, key", [({"questions": "count,size"}, "questions"),
                                          ({"image_size": 100}, "image_size"), ({"fill": 1.5}, "fill"),
                                          ({"scene": "mixed"}, "scene")])
def test_bad_options_are_refused_naming_them(options, key):
    with pytest.raises(ConfigError, match=f"task.options.{key}"):
        _build(options, seed=0)
