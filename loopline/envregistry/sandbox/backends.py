"""The sandbox backends by the name a spec's `sandbox.backend` gives, and opening one. Apart from `base` (the
interface every backend implements) so that the backends import `base` and nothing imports them back; each
backend's module (and its SDK: docker, e2b) is imported only when its backend is used. A backend defined
elsewhere registers itself: `@SANDBOX_BACKENDS.register("name", settings=...)` on an async (spec, labels, model) ->
Sandbox, where `spec` is the spec's `sandbox:` section as its settings (a subclass of `spec.Sandbox`) read it."""

from __future__ import annotations

from loopline.envregistry import spec as env_spec
from loopline.envregistry.spec import SANDBOX_BACKENDS
from loopline.envregistry.sandbox.base import InfraFailure, ModelEndpoint, Sandbox


@SANDBOX_BACKENDS.register("local")
async def _local(spec: env_spec.LocalSettings, labels: dict[str, str] | None, model: ModelEndpoint | None) -> Sandbox:
    from loopline.envregistry.sandbox.local import LocalSandbox

    return LocalSandbox(spec)  # (an agent program's socket is bound in when the program starts)


@SANDBOX_BACKENDS.register("docker")
async def _docker(spec: env_spec.DockerSettings, labels: dict[str, str] | None, model: ModelEndpoint | None) -> Sandbox:
    from loopline.envregistry.sandbox.docker import DockerSandbox

    return await DockerSandbox.create(spec, labels, model.socket if model else None)


@SANDBOX_BACKENDS.register("e2b")
async def _e2b(spec: env_spec.E2BSettings, labels: dict[str, str] | None, model: ModelEndpoint | None) -> Sandbox:
    from loopline.envregistry.sandbox.e2b import E2BSandbox

    return await E2BSandbox.create(spec, labels, model)


SANDBOX_BACKENDS.check_implemented()


async def open_sandbox(spec: env_spec.Sandbox, labels: dict[str, str] | None = None, model: ModelEndpoint | None = None) -> Sandbox:
    """Start a sandbox of the declared backend and run its setup commands. `model`: the endpoint an agent
    program will call (a container gets its socket, a cloud sandbox its network rule, only when made)."""
    try:
        make = SANDBOX_BACKENDS[spec.backend]
    except KeyError as unknown:
        raise InfraFailure(str(unknown.args[0])) from None
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
