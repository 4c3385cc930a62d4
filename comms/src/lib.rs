//! dtrain-comms (collectives and transports land with issue #4).

pub mod shaping;
