"""The pieces of ``--front-processes`` that need no processes: the port check before binding with
``SO_REUSEPORT``, each other process's configuration, and the flags' validation."""

from __future__ import annotations

import argparse
import socket

import pytest

from services.common.config import ConfigError, add_arguments, from_args, to_args
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.fronts import check_port_free, child_config


def _listener(reuse_port: bool) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_in_use_is_an_error_naming_it(reuse_port: bool) -> None:
    # A listener with SO_REUSEPORT (as every gRPC server by default) would share the port silently.
    with _listener(reuse_port) as s:
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed: free again


def test_child_config() -> None:
    cfg = TokenizerConfig(model="m", etcd="e:1", front_processes=3, metrics_port=9100, port=0)
    c = child_config(cfg, 2, grpc_port=50123, http_fd=7)
    assert (c.front_index, c.port, c.http_fd, c.metrics_port) == (2, 50123, 7, 9102)
    assert c.instance_id == "tokenizer-50123-2"
    assert child_config(TokenizerConfig(model="m", etcd="e:1", metrics_port=0), 1, 1, -1).metrics_port == 0
    assert child_config(TokenizerConfig(model="m", etcd="e:1", instance_id="t"), 1, 1, -1).instance_id == "t-1"
    # The flags a front process is started with rebuild its configuration.
    parser = argparse.ArgumentParser()
    add_arguments(parser, TokenizerConfig)
    assert from_args(TokenizerConfig, parser.parse_args(to_args(c))) == c


@pytest.mark.parametrize(("values", "field"), [({"front_processes": 0}, "front_processes"),
                                               ({"front_processes": 2, "front_index": 2}, "front_index"),
                                               ({"front_index": -1}, "front_index")])  # fmt: skip
def test_bad_front_flags_name_the_field(values: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        TokenizerConfig(model="m", etcd="e:1", **values).validate()  # type: ignore[arg-type]
