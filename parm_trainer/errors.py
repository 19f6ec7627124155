"""The errors a user's input can cause, each ending the job with one line that names the cause.

Every one is raised alike on every rank (a check without communication, or after a collective
that shared the verdict), so training/user_errors.user_errors prints rank 0's message and ends
all ranks with status 1. This module imports nothing: any floor may raise them.
"""


class ArgumentsError(ValueError):
    """Flags that contradict each other; the message names them."""


class LayoutError(ValueError):
    """A parallel layout or model shape that cannot run; the message names the flag."""


class InputError(ValueError):
    """A flag or input file that cannot work; the message names it."""


class ProfileError(ValueError):
    """A cost profile that cannot be used; the message names the file and the bad entry."""


class DataError(ValueError):
    """A dataset that is missing, corrupt or too small; the message names the file or flag."""


class TokenizerError(ValueError):
    """An unsupported --tokenizer-type, or a --tokenizer-model that does not load."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit the model."""


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; raised on every rank before the optimizer step."""


class FaultSpecError(ValueError):
    """PARM_FAULT that cannot be read; the message names the part."""


USER_ERRORS = (ArgumentsError, LayoutError, InputError, ProfileError, DataError, TokenizerError,
               CheckpointError, NonFiniteLossError, FaultSpecError, FileNotFoundError)
