"""customgrad: custom PyTorch ops with validated, split (input/weight) autograd.

Declare an op with :func:`op`, register its kernels, a fake kernel for ``torch.compile``, a
``save_for_backward`` function and a backward that returns a dict of gradients by argument name.
The backward splits into an input part and a weight part, so zero-bubble pipeline schedules run
it with no work done twice.
"""

from customgrad._autograd import BackwardContext as BackwardContext
from customgrad._autograd import SaveError as SaveError
from customgrad._compile import compile as compile
from customgrad._errors import ArgumentTypeError as ArgumentTypeError
from customgrad._errors import ArgumentValueError as ArgumentValueError
from customgrad._errors import CustomGradError as CustomGradError
from customgrad._errors import DefinitionError as DefinitionError
from customgrad._errors import GradientTypeError as GradientTypeError
from customgrad._errors import GradientValueError as GradientValueError
from customgrad._errors import KernelOutputError as KernelOutputError
from customgrad._errors import MissingRegistrationError as MissingRegistrationError
from customgrad._errors import ModifiedBetweenPassesError as ModifiedBetweenPassesError
from customgrad._errors import MutationError as MutationError
from customgrad._errors import UnsupportedError as UnsupportedError
from customgrad._errors import UnsupportedTorchError as UnsupportedTorchError
from customgrad._from_function import DeferredFunctionOp as DeferredFunctionOp
from customgrad._from_function import FunctionPatch as FunctionPatch
from customgrad._from_function import from_function as from_function
from customgrad._from_function import from_functions as from_functions
from customgrad._op import BackwardFn as BackwardFn
from customgrad._op import CustomOp as CustomOp
from customgrad._op import JvpFn as JvpFn
from customgrad._op import SaveForBackwardFn as SaveForBackwardFn
from customgrad._op import SharedFn as SharedFn
from customgrad._op import op as op
from customgrad._summary import CompiledRegionRow as CompiledRegionRow
from customgrad._summary import OpRow as OpRow
from customgrad._summary import Summary as Summary
from customgrad._summary import summary as summary
from customgrad._switches import no_split as no_split
from customgrad.graph import explain_split as explain_split

__version__ = "0.1.0"

# Tracebacks and reprs name the public classes where users import them:
# customgrad.GradientValueError, not customgrad._errors.GradientValueError (pickling finds them
# here too).
for _error in (
    ArgumentTypeError,
    ArgumentValueError,
    CustomGradError,
    DefinitionError,
    GradientTypeError,
    GradientValueError,
    KernelOutputError,
    MissingRegistrationError,
    ModifiedBetweenPassesError,
    MutationError,
    SaveError,
    UnsupportedError,
    UnsupportedTorchError,
    Summary,
    OpRow,
    CompiledRegionRow,
):
    _error.__module__ = __name__
del _error

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "BackwardContext",
    "BackwardFn",
    "CompiledRegionRow",
    "CustomGradError",
    "CustomOp",
    "DefinitionError",
    "DeferredFunctionOp",
    "GradientTypeError",
    "GradientValueError",
    "FunctionPatch",
    "JvpFn",
    "KernelOutputError",
    "MissingRegistrationError",
    "ModifiedBetweenPassesError",
    "MutationError",
    "OpRow",
    "SaveError",
    "SaveForBackwardFn",
    "SharedFn",
    "Summary",
    "UnsupportedError",
    "UnsupportedTorchError",
    "compile",
    "explain_split",
    "from_function",
    "from_functions",
    "no_split",
    "op",
    "summary",
]
