"""The sandbox backends by the name a spec's `sandbox.backend` gives, and opening one. Apart from `base` (the
interface every backend implements) so that the backends import `base` and nothing imports them back; each
backend's module (and its SDK: docker, e2b) is imported only when its backend is used."""

from __future__ import annotations

from typing import Awaitable, Callable, get_args, get_type_hints

from loopline.envregistry import spec as env_spec
from loopline.envregistry.sandbox.base import InfraFailure, ModelEndpoint, Sandbox


async def _local(spec: env_spec.Sandbox, labels: dict[str, str] | None, model: ModelEndpoint | None) -> Sandbox:
    from loopline.envregistry.sandbox.local import LocalSandbox

    return LocalSandbox(spec)  # (an agent program's socket is bound in when the program starts)


async def _docker(spec: env_spec.Sandbox, labels: dict[str, str] | None, model: ModelEndpoint | None) -> Sandbox:
    from loopline.envregistry.sandbox.docker import DockerSandbox

    return await DockerSandbox.create(spec, labels, model.socket if model else None)


async def _e2b(spec: env_spec.Sandbox, labels: dict[str, str] | None, model: ModelEndpoint | None) -> Sandbox:
    from loopline.envregistry.sandbox.e2b import E2BSandbox

    return await E2BSandbox.create(spec, labels, model)


BACKENDS: dict[str, Callable[[env_spec.Sandbox, dict[str, str] | None, ModelEndpoint | None], Awaitable[Sandbox]]] = {
    "local": _local, "docker": _docker, "e2b": _e2b,
}
assert set(BACKENDS) == set(get_args(get_type_hints(env_spec.Sandbox)["backend"])), (
    "envregistry/spec.Sandbox.backend and sandbox/backends.BACKENDS must name the same backends"
)


async def open_sandbox(spec: env_spec.Sandbox, labels: dict[str, str] | None = None, model: ModelEndpoint | None = None) -> Sandbox:
    """Start a sandbox of the declared backend and run its setup commands. `model`: the endpoint an agent
    program will call (a container gets its socket, a cloud sandbox its network rule, only when made)."""
    make = BACKENDS.get(spec.backend)
    if make is None:
        raise InfraFailure(f"no sandbox backend {spec.backend!r}; the backends are: {', '.join(BACKENDS)}")
    sandbox = await make(spec, labels, model)
    try:
        for command in spec.setup:
            result = await sandbox.exec(command, timeout_s=300)
            if not result.ok:
                raise InfraFailure(f"setup command {command!r} failed ({result.exit_code}): {result.stderr[-500:]}")
    except BaseException:
        await sandbox.close()
        raise
    return sandbox
