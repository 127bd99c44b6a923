"""Catalogs: where model names come from, what they are, and how each is loaded (a LoadPlan for residency).

`StoreCatalog` is the model store: a stored model's weights (a GGUF blob, or a safetensors repository's directory,
`Store.model_path`) are opened by `open_engine` (engine/factory.py picks the engine), bound with the Modelfile's
TEMPLATE (Go) or else the model's own chat template, and its PARAMETERs as sampling defaults. Names created FROM
the same weights with the same load-time options plan the same WeightsKey, so they share one engine instance.
`StaticCatalog` serves models already loaded (tests, fixed deployments).
"""

from lmserve.service.catalog.details import gguf_details
from lmserve.service.catalog.protocol import Catalog, ModelDescription, ModelListing, ModelSettings
from lmserve.service.catalog.static_catalog import StaticCatalog
from lmserve.service.catalog.store_catalog import StoreCatalog

__all__ = ["Catalog", "ModelDescription", "ModelListing", "ModelSettings", "StaticCatalog", "StoreCatalog",
           "gguf_details"]
