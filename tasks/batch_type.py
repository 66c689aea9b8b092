"""Flyte type for :class:`models.data.batch.RolloutBatch`: a single-blob literal holding the URI.

Tasks declare ``RolloutBatch`` inputs and outputs; Flyte moves only the URI, never the
rows. A batch already written (the usual case: tasks write to the run's storage prefix,
:class:`models.run.layout.RunLayout`) passes its own URI unchanged. An unwritten batch is
written once to Flyte's raw-output prefix. The receiving task gets a lazy batch that reads
the file (memory-mapped when local) on first use.

Importing this module registers the transformer; every task module that passes a batch imports it
(:mod:`tasks.caching` does; :mod:`models.data.batch` itself knows nothing of Flyte).
"""

from __future__ import annotations

from typing import Type

from flytekit import FlyteContext
from flytekit.core.type_engine import TypeEngine, TypeTransformer, TypeTransformerFailedError
from flytekit.models.core.types import BlobType
from flytekit.models.literals import Blob, BlobMetadata, Literal, Scalar
from flytekit.models.types import LiteralType

from models.data.batch import RolloutBatch

ARROW_FORMAT = "arrow"
_BLOB_TYPE = BlobType(format=ARROW_FORMAT, dimensionality=BlobType.BlobDimensionality.SINGLE)


class RolloutBatchTransformer(TypeTransformer[RolloutBatch]):
    """RolloutBatch <-> Flyte ``Blob(format="arrow", uri=...)``."""

    def __init__(self) -> None:
        super().__init__(name="RolloutBatch", t=RolloutBatch)

    def get_literal_type(self, t: Type[RolloutBatch]) -> LiteralType:
        return LiteralType(blob=_BLOB_TYPE)

    def to_literal(self, ctx: FlyteContext, python_val: RolloutBatch, python_type: Type[RolloutBatch],
                   expected: LiteralType) -> Literal:
        if not isinstance(python_val, RolloutBatch):
            raise TypeTransformerFailedError(f"expected a RolloutBatch, got {type(python_val).__name__}")
        uri = python_val.uri
        if uri is None:  # not written yet: one copy into Flyte's raw-output space
            uri = ctx.file_access.put_raw_data(python_val.to_ipc_bytes(), file_name="batch.arrow")
        return Literal(scalar=Scalar(blob=Blob(metadata=BlobMetadata(type=_BLOB_TYPE), uri=str(uri))))

    def to_python_value(self, ctx: FlyteContext, lv: Literal,
                        expected_python_type: Type[RolloutBatch]) -> RolloutBatch:
        blob = lv.scalar.blob if lv.scalar is not None else None
        if blob is None or not blob.uri:
            raise TypeTransformerFailedError(f"cannot make a RolloutBatch from literal {lv}")
        return RolloutBatch.open(blob.uri)

    def guess_python_type(self, literal_type: LiteralType) -> Type[RolloutBatch]:
        if literal_type.blob is not None and literal_type.blob.format == ARROW_FORMAT:
            return RolloutBatch
        raise ValueError(f"{self.name} transformer cannot reverse {literal_type}")


TypeEngine.register(RolloutBatchTransformer())
