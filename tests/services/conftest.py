"""Fixtures shared by the service tests."""

from tests.openai_stack import _openai_shared, openai_base, openai_client, openai_stack  # noqa: F401
