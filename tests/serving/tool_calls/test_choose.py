"""Which parser a checkpoint gets: the real SmolLM2 (a plain ChatML template on a llama architecture)
gets hermes, a template's own call marker decides, then the architecture; config overrides."""

from __future__ import annotations

import os

import pytest

from pddjax.model.meta import model_facts
from serving.tool_calls.choose import choose
from tests.support.paths import FIXTURES

USES_TOOLS = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{{ messages[0].content }}"


def test_smollm2_gets_hermes():
    _, tok = model_facts("smollm2-135m")  # no weights: the router's and gateway's path
    assert choose(tok.chat_template, "llama") == "hermes"  # its template reads no tools: the Hermes preamble


@pytest.mark.parametrize("marker,family", [("<tool_call>", "hermes"), ("<|python_tag|>", "llama3"),
                                           ("[TOOL_CALLS]", "mistral")])
def test_the_templates_marker_decides(marker, family):
    template = USES_TOOLS + "{{ '" + marker + "' }}"
    assert choose(template, "qwen2") == family
    assert choose(template, "LlamaForCausalLM") == family


@pytest.mark.parametrize("arch,family", [("LlamaForCausalLM", "llama3"), ("llama", "llama3"),
                                         ("MistralForCausalLM", "mistral"), ("qwen3", "hermes"), (None, "hermes")])
def test_a_template_that_reads_tools_without_a_marker_goes_by_architecture(arch, family):
    assert choose(USES_TOOLS, arch) == family


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_fixture_checkpoints_templates_read_no_tools(arch):
    _, tok = model_facts(os.path.join(FIXTURES, "hf", arch))
    assert choose(tok.chat_template, arch) == "hermes"
    assert choose(None, arch) == "hermes"


def test_config_overrides():
    _, tok = model_facts("smollm2-135m")
    assert choose(tok.chat_template, "llama", override="llama3") == "llama3"
    with pytest.raises(ValueError, match="tool_parser 'xml' is not one of hermes, llama3, mistral"):
        choose(tok.chat_template, override="xml")
