"""The routes that are no dialect of their own: tokenizing, fill-in-the-middle, judgments (decisions, rerank, score,
classify), the gateways' reads, files and batches. They may reuse a dialect's translators."""
