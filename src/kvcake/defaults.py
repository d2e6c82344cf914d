"""The names and defaults the faces show before any model runs (``kvcake --help``, option
choices), in a module that imports nothing: the command line parses its options, prints its
help and refuses a typo without loading torch or transformers (about 6 s of imports here).
The modules that act on these values import them from here."""

#: The model every face loads when none is named (``kvcake.models.resolve_builtin``).
DEFAULT_MODEL = "smollm2-135m-instruct"

#: "question": the compressed prompt ends with the question; "context": a document compressed
#: alone, questions asked after it (``kvcake.temperatures`` holds a temperature set for each).
SCENARIOS = ("question", "context")

#: ``kv_dtype`` values (``kvcake.fp8``); None: the model's own dtype.
KV_FORMATS = ("fp8",)

#: The kept fraction used when neither a budget nor a keep ratio is given, per scenario
#: ("question": the question is compressed with the prompt; "context": a document compressed
#: alone, questions asked after it). Evidence, docs/results.md (default model, 12 prompts of 2k
#: and 4k tokens): question-aware, every preset scores 67-72 against the full cache's 72 from
#: ratio 0.1 up, so 0.25 costs little; context-only, scores fall to 0-25 at 0.25 and 8-42 at 0.5
#: (full cache 72), so a document keeps half: the least that keeps some answers, not a guarantee.
DEFAULT_KEEP_RATIO = {"question": 0.25, "context": 0.5}

#: ``kvcake calibrate``'s defaults (``kvcake.calibration.api.calibrate``): kept ratios, text,
#: samples per scenario, prompt length in tokens, grid points per temperature axis.
CALIBRATION_RATIOS = (0.1, 0.25, 0.5)
CALIBRATION_TEXT = "paul_graham"
CALIBRATION_SAMPLES = 16
CALIBRATION_LENGTH = 2048
CALIBRATION_GRID = 5
