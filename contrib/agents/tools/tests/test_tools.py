"""Tools from an environment's methods, their argument checks, Hermes tool-call parsing and verl's tool formats
(its tool-config YAML and per-row tools_kwargs). Pure logic: no engine, no model."""
import asyncio
import json
import textwrap
from typing import Any, Literal, Optional

import pytest

from rlcore.errors import ConfigError, PluginError
from rlcore_agent_tools.hermes import HERMES, ToolCall, content_before_calls, hermes_calls
from rlcore_agent_tools.tools import Tool, environment_tools, tool_result_text
from rlcore_agent_tools.verl_tools import (VERL_TOOLS, ToolKwargs, VerlToolEnvironment, read_verl_tool_config,
                                           split_tools_kwargs)


class Library:
    """A lending library: what a tool-using model might search and borrow from."""

    def __init__(self):
        self.loans: list[int] = []

    def reset(self, **row) -> str | None:
        return f"Welcome, {row.get('reader', 'reader')}."

    def search(self, query: str, limit: int = 5, genres: list[str] | None = None,
               sort: Literal["title", "year"] = "title") -> list[dict]:
        """Search the catalogue by words in the title.

        Results come back best match first.

        Args:
            query: Words to look for in titles,
                matched case-insensitively.
            limit (int): At most this many results.
            genres: Only books of these genres.
            sort: The order of the results.

        Returns:
            The matching books.
        """
        return [{"id": 7, "title": query.title()}][:limit]

    def borrow(self, book_id: int, weeks: float = 2.0, renew: bool = False) -> str:
        """Borrow a book.

        Args:
            book_id: The book's id, as search gives it.
        """
        self.loans.append(book_id)
        return f"book {book_id} is yours for {weeks:g} weeks"

    def rate(self, ratings: dict[str, int], comment: Optional[str] = None) -> None:
        """Rate books by title (1 to 5)."""

    @staticmethod
    def opening_hours(day: Literal[1, 2, 3, 4, 5, 6, 7]) -> str:
        """When the library is open on a day of the week."""
        return "9-17"

    def reward(self) -> float:
        return float(len(self.loans))

    def close(self) -> None:
        pass

    def _shelve(self, book_id) -> None:
        pass

    @property
    def busy(self) -> bool:
        return False


def test_every_documented_public_method_is_a_tool_with_its_schema_from_signature_and_docstring():
    tools = environment_tools(Library())
    assert list(tools) == ["search", "borrow", "rate", "opening_hours"]     # not reset/reward/close/_shelve/busy
    assert tools["search"].schema() == {"type": "function", "function": {
        "name": "search",
        "description": "Search the catalogue by words in the title.",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": "Words to look for in titles, matched case-insensitively."},
            "limit": {"type": "integer", "description": "At most this many results."},
            "genres": {"type": ["array", "null"], "items": {"type": "string"},
                       "description": "Only books of these genres."},
            "sort": {"type": "string", "enum": ["title", "year"], "description": "The order of the results."}}}}}
    assert tools["borrow"].parameters == {"type": "object", "required": ["book_id"], "properties": {
        "book_id": {"type": "integer", "description": "The book's id, as search gives it."},
        "weeks": {"type": "number"}, "renew": {"type": "boolean"}}}
    assert tools["rate"].parameters["properties"] == {
        "ratings": {"type": "object", "additionalProperties": {"type": "integer"}},
        "comment": {"type": ["string", "null"]}}
    assert tools["opening_hours"].parameters["properties"]["day"] == {"type": "integer", "enum": [1, 2, 3, 4, 5, 6, 7]}
    assert tools["search"].description == "Search the catalogue by words in the title."
    json.dumps([t.schema() for t in tools.values()])                        # what a chat template is given


def test_tools_are_bound_to_the_environment_they_came_from():
    first, second = Library(), Library()
    environment_tools(first)["borrow"].call(book_id=3)
    assert (first.loans, second.loans) == ([3], [])
    assert environment_tools(second)["opening_hours"].call(day=1) == "9-17"


def _env(body: str) -> object:
    namespace: dict[str, Any] = {"Literal": Literal}
    exec(textwrap.dedent(body), namespace)
    return namespace["Shop"]()


@pytest.mark.parametrize("body, expected", [
    ("""
     class Shop:
         def buy(self, item: str) -> str:
             return item
     """, "environment Shop: public method 'buy' has no docstring; document it"),
    ("""
     class Shop:
         def buy(self, item) -> str:
             '''Buy an item.'''
     """, "environment Shop: public method 'buy' has no type hint for 'item'; annotate every parameter"),
    ("""
     class Shop:
         def buy(self, *items: str) -> str:
             '''Buy items.'''
     """, "environment Shop: public method 'buy' takes *items; a tool's arguments must be named, typed"),
    ("""
     class Shop:
         def buy(self, items: set[str]) -> str:
             '''Buy items.'''
     """, "environment Shop: public method 'buy': parameter 'items' has type set[str], which has no JSON schema"),
    ("""
     class Shop:
         def buy(self, item: str) -> str:
             '''Buy an item.

             Args:
                 thing: What to buy.
             '''
     """, "environment Shop: public method 'buy': its docstring's Args describe 'thing', which it does not take"),
])
def test_a_method_the_model_cannot_be_told_about_is_one_line_naming_class_and_method(body, expected):
    with pytest.raises(PluginError) as e:
        environment_tools(_env(body))
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)
    assert "'_buy'" in str(e.value) or "docstring" in str(e.value) or "use str" in str(e.value)


@pytest.mark.parametrize("arguments, expected", [
    ({"query": "dune"}, ""),
    ({"query": "dune", "limit": 3, "genres": ["sf"], "sort": "year"}, ""),
    ({"query": "dune", "genres": None}, ""),
    ({}, "search: missing argument 'query'"),
    ({"query": "dune", "page": 2}, "search: unknown argument 'page' (it takes query, limit, genres, sort)"),
    ({"query": 42}, "search: argument 'query' must be a string, got an integer"),
    ({"query": "dune", "limit": "3"}, "search: argument 'limit' must be an integer, got a string"),
    ({"query": "dune", "limit": 2.5}, "search: argument 'limit' must be an integer, got a number"),
    ({"query": "dune", "limit": True}, "search: argument 'limit' must be an integer, got a boolean"),
    ({"query": "dune", "genres": "sf"}, "search: argument 'genres' must be an array or null, got a string"),
    ({"query": "dune", "genres": ["sf", 1]}, "search: argument 'genres' item 1 must be a string, got an integer"),
    ({"query": "dune", "sort": "author"}, 'search: argument \'sort\' must be one of ["title", "year"], got "author"'),
    (["dune"], "search: arguments must be a JSON object, got an array"),
])
def test_check_names_the_first_thing_wrong_with_the_arguments(arguments, expected):
    assert environment_tools(Library())["search"].check(arguments) == expected


def test_check_reads_nested_schemas_and_takes_numbers_for_floats():
    tools = environment_tools(Library())
    assert tools["borrow"].check({"book_id": 1, "weeks": 3}) == ""
    assert tools["rate"].check({"ratings": {"Dune": 5, "Emma": "4"}}) == \
        "rate: argument 'ratings' key 'Emma' must be an integer, got a string"
    assert tools["opening_hours"].check({"day": 8}) == "opening_hours: argument 'day' must be one of [1, 2, 3, 4, 5, " \
                                                       "6, 7], got 8"


def test_tool_results_are_the_text_the_model_reads():
    assert tool_result_text("42") == "42"
    assert tool_result_text(42) == "42"
    assert tool_result_text(None) == ""
    assert tool_result_text({"title": "Dune", "year": 1965}) == '{"title": "Dune", "year": 1965}'
    assert tool_result_text([1, "ü"]) == '[1, "ü"]'


def test_hermes_reads_every_call_in_order_with_the_text_around_them():
    text = ('I will look it up.\n<tool_call>\n{"name": "search", "arguments": {"query": "dune", "limit": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "borrow", "arguments": {"book_id": 7}}\n</tool_call>')
    assert hermes_calls(text) == [ToolCall("search", {"query": "dune", "limit": 2}), ToolCall("borrow", {"book_id": 7})]
    assert content_before_calls(text) == "I will look it up."
    assert hermes_calls("The answer is 42.") == [] and content_before_calls("The answer is 42. ") == "The answer is 42."


def test_hermes_keeps_braces_and_closing_tags_inside_strings():
    code = 'def f():\n    return {"a": [1, {"b": "}"}]}\nprint("</tool_call>")'
    text = f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call> after'
    assert hermes_calls(text) == [ToolCall("python", {"code": code})]
    assert content_before_calls(text) == "after"


@pytest.mark.parametrize("body, name, error", [
    ('{"name": "search", "arguments": {"query": "dune",}}', "", "the tool call is not valid JSON (Expecting property "
                                                                "name enclosed in double quotes at character 49)"),
    ('{"arguments": {"query": "dune"}}', "", 'the tool call has no "name"; write {"name": "<tool>", "arguments": '
                                             '{...}}'),
    ('["search", {"query": "dune"}]', "", "the tool call is an array, not an object"),
    ('{"name": "search", "arguments": "{\\"query\\": \\"dune\\"}"}', "search",
     'search: "arguments" must be a JSON object, got a string'),
])
def test_a_malformed_call_is_a_call_with_an_error_and_the_others_still_read(body, name, error):
    calls = hermes_calls(f'<tool_call>{body}</tool_call>\n<tool_call>{{"name": "borrow", "arguments": '
                         f'{{"book_id": 7}}}}</tool_call>')
    assert len(calls) == 2 and calls[1] == ToolCall("borrow", {"book_id": 7})
    assert calls[0].name == name and calls[0].arguments == {} and calls[0].error.startswith(error)


def test_an_unclosed_call_is_an_error_after_the_calls_before_it():
    calls = hermes_calls('<tool_call>{"name": "borrow", "arguments": {}}</tool_call> and <tool_call>{"name": "se')
    assert calls == [ToolCall("borrow", {}),
                     ToolCall("", {}, error="unclosed <tool_call>: end every call with </tool_call>")]
    assert content_before_calls('Hm. <tool_call>{"name": "se') == "Hm."


def test_a_call_without_arguments_has_none():
    assert hermes_calls('<tool_call>{"name": "opening_hours"}</tool_call>') == [ToolCall("opening_hours", {})]


def test_the_tools_plugin_registers_the_hermes_parser_and_only_it():
    from rlcore.plugins import load_plugins

    assert load_plugins(["tools"]).registry.get("tool_parsers", "hermes") is HERMES
    assert load_plugins(["grpo"]).registry.table("tool_parsers") == {}      # the kind comes with its plugin


# verl's formats. A tool class as a user's package would define it, with verl's BaseTool methods (verl itself is not
# installed here); a tool config in the layout of verl's examples/sglang_multiturn/config/tool_config/*.yaml.
GRADER = '''
import asyncio
from uuid import uuid4

class Response:
    def __init__(self, text=None):
        self.text, self.image, self.video = text, None, None

class AnswerGrader:
    log = []

    def __init__(self, config, tool_schema):
        self.config, self.name = config, tool_schema.function.name
        self.instances = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        ground_truth = ground_truth or kwargs.get("create_kwargs", {}).get("ground_truth")
        instance_id = instance_id or str(uuid4())
        self.instances[instance_id] = {"truth": ground_truth, "answer": None, "loop": asyncio.get_running_loop()}
        return instance_id, Response()

    async def execute(self, instance_id, parameters, **kwargs):
        state = self.instances[instance_id]
        assert state["loop"] is asyncio.get_running_loop()
        if parameters.get("answer") == "slow":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.log.append("cancelled")
                raise
        state["answer"] = parameters["answer"]
        right = state["answer"] == state["truth"]
        return Response(f"answer {parameters['answer']}: {'right' if right else 'wrong'}"), 0.1 * right, {"n": 1}

    async def calc_reward(self, instance_id, scale=1.0, **kwargs):
        state = self.instances[instance_id]
        return scale * (state["answer"] == state["truth"])

    async def release(self, instance_id, **kwargs):
        del self.instances[instance_id]

class NotATool:
    def __init__(self, config, tool_schema):
        pass

    def execute(self, instance_id, parameters):
        return "sync"
'''

CONFIG = '''
tools:
  - class_name: "verl_style_tools.AnswerGrader"
    config:
      type: native
      scale_hint: 2
    tool_schema:
      type: "function"
      function:
        name: "grade_answer"
        description: "Grade the final answer (1.0 if it is right)."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The answer, digits only."
          required: ["answer"]
'''


@pytest.fixture
def tool_config(tmp_path, monkeypatch):
    (tmp_path / "verl_style_tools.py").write_text(GRADER)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(text: str) -> str:
        path = tmp_path / "tool_config.yaml"
        path.write_text(textwrap.dedent(text))
        return str(path)
    return write


def test_a_verl_tool_config_gives_its_function_tools(tool_config):
    [tool] = read_verl_tool_config(tool_config(CONFIG))
    assert (tool.name, tool.class_name) == ("grade_answer", "verl_style_tools.AnswerGrader")
    assert tool.schema()["function"]["parameters"]["required"] == ["answer"]
    assert tool.tool.config == {"type": "native", "scale_hint": 2} and tool.tool.name == "grade_answer"


def test_a_verl_row_runs_through_an_episode_of_its_tools(tool_config):
    env = VerlToolEnvironment(read_verl_tool_config(tool_config(CONFIG)))
    tools = environment_tools(env)
    assert list(tools) == ["grade_answer"] and isinstance(tools["grade_answer"], Tool)
    row = {"data_source": "openai/gsm8k", "extra_info": {"need_tools_kwargs": True, "tools_kwargs": {"grade_answer": {
        "create_kwargs": {"ground_truth": "72"}, "calc_reward_kwargs": {"scale": 2.0}}}}}
    assert env.reset(**row) is None
    grader = env._verl["grade_answer"].tool
    assert [s["truth"] for s in grader.instances.values()] == ["72"]
    assert tools["grade_answer"].check({"answer": 72}) == \
        "grade_answer: argument 'answer' must be a string, got an integer"

    async def answer(*answers: str) -> list[str]:
        return [await tools["grade_answer"].call(answer=a) for a in answers]
    assert asyncio.run(answer("71", "72")) == ["answer 71: wrong", "answer 72: right"]
    assert env.step_rewards == [("grade_answer", 0.0), ("grade_answer", 0.1)]
    assert env.reward() == {"grade_answer": 2.0}
    env.close()
    assert grader.instances == {}


def test_the_verl_tools_environment_reads_its_config_once_and_makes_a_fresh_episode_each_time(tool_config):
    options = {"tool_config_path": tool_config(CONFIG)}
    first, second = VERL_TOOLS.make(options), VERL_TOOLS.make(options)
    assert first is not second and first._verl["grade_answer"] is second._verl["grade_answer"]
    first.reset(tools_kwargs={"grade_answer": {"create_kwargs": {"ground_truth": "1"}}})
    second.reset(tools_kwargs={"grade_answer": {"create_kwargs": {"ground_truth": "2"}}})
    asyncio.run(environment_tools(second)["grade_answer"].call(answer="2"))
    assert (first.reward(), second.reward()) == ({"grade_answer": 0.0}, {"grade_answer": 1.0})
    first.close(), second.close()
    with pytest.raises(ConfigError, match=r"^agent.options.path is not read by the verl_tools environment"):
        VERL_TOOLS.make({"path": "x.yaml"})
    with pytest.raises(ConfigError, match=r"^agent.environment=verl_tools needs agent.options.tool_config_path"):
        VERL_TOOLS.make({})


def test_a_tool_call_timed_out_by_the_agent_is_cancelled_in_the_tools_loop(tool_config):
    env = VerlToolEnvironment(read_verl_tool_config(tool_config(CONFIG)))
    env.reset(tools_kwargs={"grade_answer": {"create_kwargs": {"ground_truth": "1"}}})
    grader = env._verl["grade_answer"].tool
    grader.log.clear()
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(environment_tools(env)["grade_answer"].call(answer="slow"), 0.2))
    for _ in range(100):
        if grader.log:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert grader.log == ["cancelled"]
    env.close()


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.replace("type: native", "type: mcp"),
     "tools[0] (verl_style_tools.AnswerGrader): config.type='mcp' is not supported: MCP tools are not supported"),
    (lambda c: c + "    mcp:\n      mcp_servers_config_path: ./mcp_server.json\n",
     "tools[0] (verl_style_tools.AnswerGrader): key 'mcp' is not supported: MCP tools are not supported"),
    (lambda c: c.replace("type: native", "type: sandbox"),
     "config.type='sandbox' is not supported: verl knows native and mcp, rlcore runs native"),
    (lambda c: c.replace("type: native", "kind: native"),
     "tools[0] (verl_style_tools.AnswerGrader): 'config' needs 'type: native'"),
    (lambda c: c + "    rate_limit: 3\n", "key 'rate_limit' is not supported: rlcore reads class_name, config, "
                                          "tool_schema; remove it"),
    (lambda c: c.replace("verl_style_tools.AnswerGrader", "verl_style_tools.Missing"),
     "tools[0] (verl_style_tools.Missing): class_name 'verl_style_tools.Missing' cannot be imported (AttributeError"),
    (lambda c: c.replace("verl_style_tools.AnswerGrader", "no_such_package.Tool"),
     "class_name 'no_such_package.Tool' cannot be imported (ModuleNotFoundError"),
    (lambda c: c.replace("verl_style_tools.AnswerGrader", "verl_style_tools.NotATool"),
     "verl_style_tools.NotATool is not a verl BaseTool: it has no async method 'create'"),
    (lambda c: c.replace('name: "grade_answer"', 'title: "grade_answer"'),
     "tool_schema.function key 'title' is not read"),
    (lambda c: c.replace('type: "function"', 'type: "retrieval"'), "tool_schema must be {type: function"),
    (lambda c: c + c.split("tools:\n")[1], "two tools are named 'grade_answer'"),
    (lambda c: c.replace("tools:", "tool:"), "has no list 'tools' at its top"),
    (lambda c: c + "interaction: []\n", "top-level key 'interaction' is not read"),
])
def test_what_a_tool_config_cannot_run_is_refused_by_key(tool_config, edit, expected):
    path = tool_config(edit(CONFIG))
    with pytest.raises(ConfigError) as e:
        read_verl_tool_config(path)
    message = str(e.value)
    assert f"verl tool config {path!r}" in message and expected in message and "\n" not in message


def test_a_missing_tool_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read: No such file or directory"):
        read_verl_tool_config(str(tmp_path / "nope.yaml"))


def test_tools_kwargs_split_into_each_tools_calls():
    split = split_tools_kwargs({"grade_answer": {"create_kwargs": {"ground_truth": "72"}, "execute_kwargs": {},
                                                 "calc_reward_kwargs": {"scale": 2}, "release_kwargs": {}}},
                               ["grade_answer", "search"])
    assert split == {"grade_answer": ToolKwargs(create={"ground_truth": "72"}, calc_reward={"scale": 2}),
                     "search": ToolKwargs()}
    assert split_tools_kwargs(None, ["search"]) == {"search": ToolKwargs()}


@pytest.mark.parametrize("tools_kwargs, expected", [
    ({"grade": {}}, "extra_info.tools_kwargs names tool 'grade', which the tool config does not define (it defines "
                    "grade_answer)"),
    ({"grade_answer": {"create_kwarg": {}}}, "extra_info.tools_kwargs.grade_answer: key 'create_kwarg' is not one "
                                             "of verl's create_kwargs, execute_kwargs"),
    ({"grade_answer": {"create_kwargs": "72"}}, "extra_info.tools_kwargs.grade_answer.create_kwargs must be a "
                                                "mapping of keyword arguments, got str"),
    ({"grade_answer": {"create_kwargs": {"instance_id": "x"}}}, "extra_info.tools_kwargs.grade_answer.create_kwargs "
                                                                "sets 'instance_id', which rlcore passes itself"),
    (["grade_answer"], "extra_info.tools_kwargs must map tool names to"),
])
def test_bad_tools_kwargs_are_refused_by_key(tools_kwargs, expected):
    with pytest.raises(ConfigError) as e:
        split_tools_kwargs(tools_kwargs, ["grade_answer"])
    assert str(e.value).startswith(expected)


def test_tools_kwargs_read_back_from_parquet_treat_absent_keys_as_none(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from rlcore.datasets.files import _rows

    rows = [{"extra_info": {"tools_kwargs": {"grade_answer": {"create_kwargs": {"ground_truth": "72"}}}}},
            {"extra_info": {"tools_kwargs": {"grade_answer": {"create_kwargs": {"ground_truth": "9", "unit": "kg"}},
                                             "search": {"create_kwargs": {"index": "wiki"},
                                                        "execute_kwargs": {"top_k": 3}}}}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    first, second = (row["extra_info"]["tools_kwargs"] for row in _rows(str(tmp_path / "train.parquet"), ".parquet"))
    assert first == {"grade_answer": {"create_kwargs": {"ground_truth": "72", "unit": None}}, "search": None}
    assert split_tools_kwargs(first, ["grade_answer", "search"]) == {
        "grade_answer": ToolKwargs(create={"ground_truth": "72"}), "search": ToolKwargs()}
    assert split_tools_kwargs(second, ["grade_answer", "search"])["search"] == \
        ToolKwargs(create={"index": "wiki"}, execute={"top_k": 3})
