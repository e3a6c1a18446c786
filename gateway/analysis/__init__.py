"""Prompt analysis: a request's exact prompt tokens and vLLM block hashes, off the event loop.

One interface: ``await PromptAnalyzer(models, config).analyze(AnalysisRequest(...)) -> Analysis``
(or :class:`AnalysisSkipped`: route on the approximate index). Behind it: the chat renderer
(``chat_render``: vLLM's normalisation and the model's template), the tokenizer with its
content-keyed incremental cache (``tokenize``), the fast byte-level BPE encoder (``fast_bpe``),
and the worker processes (``worker``) the analyzer (``analyzer``) spreads requests over.
Nothing outside this package imports those modules.
"""

from gateway.analysis.analyzer import Analysis, AnalysisRequest, AnalysisSkipped, PromptAnalyzer, SkipCounter

__all__ = ["Analysis", "AnalysisRequest", "AnalysisSkipped", "PromptAnalyzer", "SkipCounter"]
