"""The ``LLMServe`` API: the pydantic model shared by the CRD, the operator and replay.

Only schema and validation live here: no planning, no Kubernetes client.
"""

from fulcrum.api.llmserve import (
    API_VERSION,
    KIND,
    EngineSpec,
    ForecasterMethod,
    ForecasterSpec,
    GPUSpec,
    LLMServe,
    LLMServeSpec,
    Mode,
    ModelSpec,
    ObjectMeta,
    ProfileRef,
    RouterPolicy,
    RouterSpec,
    ScalingSpec,
    SLOSpec,
    load_llmserve,
    parse_llmserve,
)

__all__ = [
    "API_VERSION",
    "KIND",
    "EngineSpec",
    "ForecasterMethod",
    "ForecasterSpec",
    "GPUSpec",
    "LLMServe",
    "LLMServeSpec",
    "Mode",
    "ModelSpec",
    "ObjectMeta",
    "ProfileRef",
    "RouterPolicy",
    "RouterSpec",
    "ScalingSpec",
    "SLOSpec",
    "load_llmserve",
    "parse_llmserve",
]
