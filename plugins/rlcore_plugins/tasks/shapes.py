"""Built-in visual task: coloured squares in a 2 x 2 grid, and a question about them ("<image> count red" -> "2",
"<image> colour top left" -> "blue" or "none"; or, in the ``group`` scene the visual quickstart trains, 0-4 squares
of one colour: "<image> count" -> "3", "<image> colour" -> "blue"), exact-match reward; a word-level tokenizer, so
that a tiny vision-language model is built and trained locally with nothing downloaded. The images are drawn here
(PIL), the held-out set fixed by its own seed, the training images by the run's seed and the step."""
from __future__ import annotations

import random
from dataclasses import dataclass

from rlcore.errors import ConfigError
from rlcore.multimodal import IMAGE_TAG, IMAGES
from rlcore.specs import Task, TaskSpec

EOS = "<|endoftext|>"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
CELLS = ("top left", "top right", "bottom left", "bottom right")
QUESTIONS = ("count", "colour")
SCENES = ("grid", "group")
WORDS = ("count", "colour", "top", "bottom", "left", "right", "none", *COLOURS, *"01234")
EVAL_SPLIT_SEED = 4321   # the held-out set does not depend on the run seed, so runs are comparable


@dataclass
class ShapesOptions:
    questions: str = "count,colour"   # which are asked: count (of a colour; group: of the squares), colour (of a cell)
    scene: str = "grid"               # grid: each cell empty or a square of any colour; group: 0-4 squares (a
                                      # uniform count) of one colour, asked "count" / "colour" of the whole picture
    image_size: int = 112             # pixels per side (the tiny model's processor keeps 112 x 112 whole)
    fill: float = 0.6                 # the chance that a cell holds a square (grid scene)
    eval_size: int = 200              # held-out questions, images never trained on


class Shapes(Task):
    def __init__(self, options: ShapesOptions, seed: int):
        self.questions = tuple(q.strip() for q in options.questions.split(","))
        if not self.questions or set(self.questions) - set(QUESTIONS):
            raise ConfigError(f"task.options.questions = {options.questions!r}: a comma-separated choice of "
                              f"{', '.join(QUESTIONS)}")
        if options.image_size < 56 or options.image_size % 28:
            raise ConfigError(f"task.options.image_size = {options.image_size}: a multiple of 28, at least 56")
        if options.scene not in SCENES:
            raise ConfigError(f"task.options.scene = {options.scene!r}: one of {', '.join(SCENES)}")
        if not 0 <= options.fill <= 1:
            raise ConfigError(f"task.options.fill = {options.fill}: a probability, from 0 to 1")
        self.options, self.seed = options, seed
        self.eval_set = [self._example(random.Random(f"{EVAL_SPLIT_SEED}/{i}")) for i in range(options.eval_size)]

    def _example(self, rng: random.Random) -> tuple[str, dict]:
        """A picture (each cell empty or a square of a colour, jittered in size and place) and a question on it."""
        cells, text, answer = (self._group_scene if self.options.scene == "group" else self._grid_scene)(rng)
        return f"{IMAGE_TAG} {text}", {"answer": answer, IMAGES: [self._draw(cells, rng)]}

    def _grid_scene(self, rng: random.Random) -> tuple[list[str | None], str, str]:
        """Each cell empty or a square of any colour: how many of one colour, or which colour one cell holds."""
        cells = [rng.choice(list(COLOURS)) if rng.random() < self.options.fill else None for _ in CELLS]
        if rng.choice(self.questions) == "count":
            colour = rng.choice(list(COLOURS))
            return cells, f"count {colour}", str(cells.count(colour))
        cell = rng.randrange(len(CELLS))
        return cells, f"colour {CELLS[cell]}", cells[cell] or "none"

    def _group_scene(self, rng: random.Random) -> tuple[list[str | None], str, str]:
        """0-4 squares of one colour in distinct cells: how many, and which colour ("none" without any)."""
        count, colour = rng.randint(0, len(CELLS)), rng.choice(list(COLOURS))
        chosen = set(rng.sample(range(len(CELLS)), count))
        cells = [colour if i in chosen else None for i in range(len(CELLS))]
        question = rng.choice(self.questions)
        return cells, question, str(count) if question == "count" else (colour if count else "none")

    def _draw(self, cells: list[str | None], rng: random.Random):
        from PIL import Image, ImageDraw

        size = self.options.image_size
        half = size // 2
        image = Image.new("RGB", (size, size), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for i, colour in enumerate(cells):
            if colour is None:
                continue
            side = rng.randint(half // 2, half - 4)
            x0 = (i % 2) * half + rng.randint(2, half - side - 2)
            y0 = (i // 2) * half + rng.randint(2, half - side - 2)
            draw.rectangle((x0, y0, x0 + side, y0 + side), fill=COLOURS[colour])
        return image

    def _draw_examples(self, stream: int, step: int, count: int) -> list[tuple[str, dict]]:
        return [self._example(random.Random(f"{self.seed}/{stream}/{step}/{i}")) for i in range(count)]

    def train_prompts(self, step, count):
        return self._draw_examples(0, step, count)

    def eval_prompts(self):
        return list(self.eval_set)

    def supervised_examples(self, step, count):
        """(prompt, answer, metadata): the metadata holds the prompt's image."""
        return [(p, m["answer"], m) for p, m in self._draw_examples(1, step, count)]

    def write_tokenizer(self, directory):
        """One token per word of the questions and answers (the model family adds its vision tokens)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {EOS: 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")     # words joined by spaces
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS).save_pretrained(directory)
        return len(vocab)


def _build(options: dict, seed: int) -> Shapes:
    from rlcore.config import bind_plugin_section

    return Shapes(bind_plugin_section("task.options", options, ShapesOptions), seed)


SHAPES = TaskSpec("shapes", _build, default_reward="exact_match",
                  description="coloured squares in a 2x2 grid: count a colour / name a cell's colour (scene=group: "
                              "count the squares / name their one colour); exact-match reward; word-level tokenizer "
                              "(vision-language models)")
