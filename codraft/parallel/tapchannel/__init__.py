"""TapChannel: carries policy taps from pipeline stages to the draft on the last stage, outside the schedule."""

from codraft.parallel.tapchannel.channel import TapChannel
from codraft.parallel.tapchannel.protocol import TapChannelError, TapChannelTimeout, TapSpec, required_depth

__all__ = ["TapChannel", "TapChannelError", "TapChannelTimeout", "TapSpec", "required_depth"]
