"""A pod-level stand-in for a Flyte cluster (a test tool): runs a workflow of the compiled package node
by node, each task node as its template's own container command in fresh pods (:mod:`tests.cluster.pods`),
inputs and outputs as literal protobufs in the object store, dynamic nodes by executing the
``DynamicJobSpec`` (``futures.pb``) their pod writes (nested ones too), a launch-plan node as a new
execution of the launch plan's workflow (its own id, its own node count, which the node waits for, as
propeller's launch-plan handler does), retries as propeller grants them.

Retries: ``pyflyte-execute`` exits 0 on a task error and writes ``error.pb``. A RECOVERABLE user
error, or a pod that died (non-zero exit, killed, no document), uses one of the node's ``retries``
(from the node's metadata, else the task's); a RECOVERABLE system error one of
``system_retries`` (propeller's ``max-node-retries-system-failures``, default 3); NON_RECOVERABLE
fails the node at once. Not emulated: Flyte's task cache (datacatalog; every node runs), branch,
gate, array and sub-workflow nodes, attribute-path promises, a launch plan's fixed or default inputs.

``parallelism`` > 1 runs independent nodes at once, as propeller does (1: one node at a time), at each
level of the graph. A node that fails for good aborts the execution's running nodes (their pods killed)
as propeller's default failure policy (``FAIL_IMMEDIATELY``) does, so a long-running node (a resident
run's service) never outlives a failed execution.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from flyteidl.core import errors_pb2, execution_pb2, literals_pb2, tasks_pb2

from tests.cluster.literals import (LiteralTooLarge, ObjectStore, error_summary, execution_inputs, node_inputs, resolve,
                                   upstream)
from tests.cluster.package import Package
from tests.cluster.pods import Pod, PodSettings, start_pods, wait_pods


_COUNTING = threading.Lock()


class NodeFailed(RuntimeError):
    """A node failed for good (retries spent or a non-recoverable error); names node, task and error."""


@dataclass
class Attempt:
    """One try of one node."""

    node: str
    """Node path, e.g. ``n1/0/dn3`` (a node of the dynamic spec of ``n1``'s attempt 0)."""
    task: str
    attempt: int
    pods: List[Pod]
    outcome: str = ""
    """``outputs``, ``futures``, ``error`` or ``lost`` (the pod died without a document)."""
    error: str = ""
    inputs_bytes: int = 0
    """Size of the node's ``inputs.pb``."""
    document_bytes: int = 0
    """Size of the ``outputs.pb`` or ``futures.pb`` the control plane read back."""
    seconds: float = 0.0


@dataclass
class Fault:
    """Lose the pod of ``task``'s first attempt where it reaches the fault point ``point``
    (``models/faults.py``'s pause), as a node or pod loss would."""

    task: str
    point: str


@dataclass
class Execution:
    id: str
    outputs: Optional[literals_pb2.LiteralMap] = None
    attempts: List[Attempt] = field(default_factory=list)
    """Every node attempt, of this execution and of those its launch-plan nodes started."""
    error: str = ""
    aborted: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set when a node failed for good: every running pod of the execution (and of the executions it
    launched, and of the one that launched it) is killed."""
    workflow: str = ""
    nodes: int = 0
    """Nodes of this execution's own record (static and dynamic ones, each counted once however often it
    ran), not of the executions it launched."""
    launched: List["Execution"] = field(default_factory=list)
    """The executions its launch-plan nodes started, in order (each with its own)."""
    parent: str = ""
    """The execution whose launch-plan node started this one."""

    def chain(self) -> List["Execution"]:
        """This execution and every one it launched, depth first."""
        return [self] + [e for child in self.launched for e in child.chain()]

    def of_task(self, suffix: str) -> List[Attempt]:
        return [a for a in self.attempts if a.task.endswith(suffix)]


@dataclass
class Cluster:
    package: Package
    store: ObjectStore
    metadata_prefix: str
    """Where propeller keeps each execution's inputs, outputs and errors (``s3://bucket/metadata``)."""
    raw_prefix: str
    """Raw output data (``--raw-output-data-prefix``)."""
    pods: PodSettings
    parallelism: int = 1
    system_retries: int = 3
    faults: List[Fault] = field(default_factory=list)

    def execute(self, workflow: str, inputs: Mapping[str, Any], name: str = "") -> Execution:
        """Run ``workflow`` of the package with python ``inputs``; the execution with its outputs, or its
        ``error`` (the failed node's) when it failed."""
        wf = self.package.workflows[workflow]
        ex = Execution(name or f"e{uuid.uuid4().hex[:10]}", workflow=workflow)
        try:
            ex.outputs = self._workflow(ex, execution_inputs(wf.interface, inputs))
        except NodeFailed as err:
            ex.error = str(err)
        return ex

    def _workflow(self, ex: Execution, inputs: literals_pb2.LiteralMap) -> literals_pb2.LiteralMap:
        wf = self.package.workflows[ex.workflow]
        ctx = {"execution": ex.id, "workflow": ex.workflow, "version": "harness"}
        return self._graph(ex, ctx, list(wf.nodes), self.package.tasks, inputs, list(wf.outputs), "")

    def _launch(self, ex: Execution, node, inputs: literals_pb2.LiteralMap, path: str) -> literals_pb2.LiteralMap:
        """A launch-plan node: a new execution of the plan's workflow on the node's inputs; its outputs."""
        plan = self.package.launch_plans[node.workflow_node.launchplan_ref.name]
        child = Execution(f"e{uuid.uuid4().hex[:10]}", attempts=ex.attempts, aborted=ex.aborted,
                          workflow=plan.spec.workflow_id.name, parent=ex.id)
        ex.launched.append(child)
        try:
            return self._workflow(child, inputs)
        except NodeFailed as err:
            child.error = str(err)
            raise NodeFailed(f"node {path} (launch plan {plan.id.name}): execution {child.id} failed: {err}") from err

    def run_task(self, task: str, inputs: literals_pb2.LiteralMap, name: str = "") -> Execution:
        """One node of the package's ``task`` on ``inputs``; a dynamic task's ``DynamicJobSpec`` is read
        back (within the control plane's download limit) but not executed."""
        template = self.package.tasks[task]
        ex = Execution(name or f"t{uuid.uuid4().hex[:10]}")
        ctx = {"execution": ex.id, "workflow": task, "version": "harness"}
        data = f"{self.metadata_prefix}/{ex.id}/n0/data"
        a = Attempt("n0", task, 0, [], inputs_bytes=self.store.write(f"{data}/inputs.pb", inputs))
        ex.attempts.append(a)
        try:
            ex.outputs = self._attempt(ex, ctx, a, template, f"{data}/inputs.pb", f"{data}/0")
        except LiteralTooLarge as err:
            ex.error = str(err)
        ex.error = ex.error or a.error
        return ex

    # --- the graph ----------------------------------------------------------------------------
    def _graph(self, ex: Execution, ctx, nodes, tasks: Mapping[str, tasks_pb2.TaskTemplate],
               inputs: literals_pb2.LiteralMap, outputs, path: str) -> literals_pb2.LiteralMap:
        scope: Dict[str, literals_pb2.LiteralMap] = {"": inputs}
        with _COUNTING:  # (a dynamic node's graph runs in a pool thread)
            ex.nodes += len(nodes)
        waiting = {n.id: n for n in nodes}
        deps = {n.id: upstream(n) & set(waiting) for n in nodes}
        with cf.ThreadPoolExecutor(max_workers=self.parallelism) as pool:
            running: Dict[cf.Future, str] = {}
            while waiting or running:
                for nid in [i for i in waiting if deps[i] <= set(scope)]:
                    if len(running) >= self.parallelism:
                        break
                    node = waiting.pop(nid)
                    running[pool.submit(self._node, ex, ctx, node, tasks, node_inputs(node, scope),
                                        f"{path}{nid}")] = nid
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    nid = running.pop(fut)
                    try:
                        scope[nid] = fut.result()
                    except BaseException:  # FAIL_IMMEDIATELY: the running nodes are aborted
                        ex.aborted.set()
                        raise
        return literals_pb2.LiteralMap(literals={o.var: resolve(o.binding, scope) for o in outputs})

    def _node(self, ex: Execution, ctx, node, tasks, inputs: literals_pb2.LiteralMap, path: str):
        if node.WhichOneof("target") == "workflow_node" and node.workflow_node.HasField("launchplan_ref"):
            return self._launch(ex, node, inputs, path)
        if node.WhichOneof("target") != "task_node":
            raise NotImplementedError(f"node {path}: only task and launch-plan nodes are run by the harness")
        template = tasks[node.task_node.reference_id.name]
        retries = node.metadata.retries.retries if node.metadata.HasField("retries") \
            else template.metadata.retries.retries
        data = f"{self.metadata_prefix}/{ex.id}/{path}/data"
        inputs_url = f"{data}/inputs.pb"
        size = self.store.write(inputs_url, inputs)
        user_left, system_left = retries, self.system_retries
        for attempt in itertools.count():
            if ex.aborted.is_set():
                raise NodeFailed(f"node {path} ({template.id.name}): aborted (another node failed)")
            a = Attempt(path, template.id.name, attempt, [], inputs_bytes=size)
            ex.attempts.append(a)
            try:
                out = self._attempt(ex, ctx, a, template, inputs_url, f"{data}/{attempt}")
            except LiteralTooLarge as err:  # propeller fails the node: it cannot read the document
                raise NodeFailed(f"node {path} ({template.id.name}): {err}") from err
            if a.outcome == "outputs":
                return out
            if a.outcome == "futures":
                return self._graph(ex, ctx, list(out.nodes), {t.id.name: t for t in out.tasks}, inputs,
                                   list(out.outputs), f"{path}/{attempt}/")
            system = a.outcome == "error" and out.error.origin == execution_pb2.ExecutionError.SYSTEM \
                if out is not None else False
            recoverable = a.outcome == "lost" or out.error.kind == errors_pb2.ContainerError.RECOVERABLE
            budget_left = system_left if system else user_left
            if not recoverable or budget_left == 0:
                raise NodeFailed(f"node {path} ({template.id.name}) failed on attempt {attempt}: {a.error}")
            if system:
                system_left -= 1
            else:
                user_left -= 1

    def _attempt(self, ex: Execution, ctx, a: Attempt, template, inputs_url: str, out_prefix: str):
        fault = next((f for f in self.faults if template.id.name.endswith(f.task)), None) if a.attempt == 0 else None
        name = f"{ex.id}-{a.node.replace('/', '-')}-{a.attempt}"
        extra, marker = {}, None
        if fault is not None:
            fault_dir = self.pods.root / f"{name}-fault"
            extra = {"RLHF_FAULT_PAUSE": f"{fault.point}:600", "RLHF_FAULT_DIR": str(fault_dir)}
            marker = fault_dir / "paused"
        placeholders = {"input": inputs_url, "outputPrefix": out_prefix,
                        "rawOutputDataPrefix": f"{self.raw_prefix}/{ex.id}/{a.node}/{a.attempt}",
                        "checkpointOutputPrefix": f"{self.raw_prefix}/{ex.id}/{a.node}/{a.attempt}/_flytecheckpoints",
                        "prevCheckpointPrefix": '""'}
        t0 = time.monotonic()
        a.pods = start_pods(template, self.pods, name, placeholders, ctx, a.attempt, extra)
        wait_pods(a.pods, self.pods.timeout_s, kill_when=marker, abort=ex.aborted)
        a.seconds = time.monotonic() - t0
        return self._collect(a, out_prefix)

    def _collect(self, a: Attempt, out_prefix: str):
        """What propeller reads after the pods ended: outputs, futures or an error document."""
        files = set(self.store.listdir(out_prefix))
        errors = sorted(f for f in files if f.startswith("error"))
        if errors:
            doc = self.store.read_error(f"{out_prefix}/{errors[0]}")
            a.outcome, a.error = "error", error_summary(doc)
            return doc
        if any(p.exit_code != 0 for p in a.pods):
            a.outcome = "lost"
            a.error = "; ".join(f"{p.name} exited {p.exit_code}: {p.output()[-1500:]}" for p in a.pods
                                if p.exit_code != 0)
            return None
        if "futures.pb" in files:
            a.outcome = "futures"
            doc = self.store.read_futures(f"{out_prefix}/futures.pb")
        elif "outputs.pb" in files:
            a.outcome = "outputs"
            doc = self.store.read_literals(f"{out_prefix}/outputs.pb")
        else:
            doc = None
        if doc is not None:
            a.document_bytes = doc.ByteSize()
            return doc
        a.outcome, a.error = "lost", f"no outputs.pb, futures.pb or error.pb under {out_prefix}"
        return None
