"""Sandbox backends behind one async interface (exec, files, close)."""

from loopline.envregistry.sandbox.base import ExecResult, InfraFailure, Sandbox, open_sandbox

__all__ = ["ExecResult", "InfraFailure", "Sandbox", "open_sandbox"]
