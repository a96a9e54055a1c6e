"""Every message on the troubleshooting page is one the code still produces."""

from __future__ import annotations

from doctools import messages


def test_the_page_shows_many_messages() -> None:
    shown = messages.shown_messages(messages.PAGE.read_text(encoding="utf-8"))
    assert len(shown) >= 40


def test_every_message_on_the_page_comes_from_the_code() -> None:
    problems = messages.unknown_messages()
    assert not problems, ("these messages are no longer in the code: update docs/troubleshooting.md and its "
                          "Chinese page:\n" + "\n".join(problems))


def test_a_message_that_is_not_in_the_code_is_caught(tmp_path) -> None:
    page = tmp_path / "t.md"
    page.write_text("```text\nUsageError: this message was never written by anyone in the code\n```\n")
    assert messages.unknown_messages(page)


def test_every_usage_error_of_the_magics_is_on_the_page() -> None:
    missing = messages.undocumented_usage_errors()
    assert not missing, "add these UsageError messages to docs/troubleshooting.md (and .zh.md):\n" + "\n".join(missing)
