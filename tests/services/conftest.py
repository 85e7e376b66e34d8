"""Fixtures shared by the service tests."""

from tests.openai_stack import openai_base, openai_client, openai_stack  # noqa: F401
from tests.shared_stacks import _shared_stacks, plain_stack  # noqa: F401
