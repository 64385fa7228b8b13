//! Request classes (`STRATA_QOS`): what a client declares about how its reads should be
//! scheduled when a worker is busy. A worker serves waiting requests strictly by class, with a
//! floor so the lower classes are never starved (see the worker's `classes` module).

use std::fmt;
use std::str::FromStr;

/// The environment variable a client's class is read from.
pub const QOS_ENV: &str = "STRATA_QOS";

/// How a client's reads are scheduled against other clients' on a busy worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(u8)]
pub enum QosClass {
    /// Inference, RAG, weight loading: served first, and with a few places of their own.
    Latency = 0,
    /// Training epochs, bulk reads: the default.
    #[default]
    Throughput = 1,
    /// Data cleaning, copies, anything that may wait.
    Background = 2,
}

impl QosClass {
    /// Every class, highest priority first.
    pub const ALL: [QosClass; 3] = [QosClass::Latency, QosClass::Throughput, QosClass::Background];

    pub fn as_str(self) -> &'static str {
        match self {
            QosClass::Latency => "latency",
            QosClass::Throughput => "throughput",
            QosClass::Background => "background",
        }
    }

    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.get(v as usize).copied()
    }

    /// The class `STRATA_QOS` names; unset or blank: `None`; anything else is an error that
    /// says what is accepted.
    pub fn from_env() -> Result<Option<Self>, QosParseError> {
        match std::env::var(QOS_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse().map(Some),
            _ => Ok(None),
        }
    }
}

impl fmt::Display for QosClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A class name that is none of `latency`, `throughput`, `background`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a request class: latency, throughput (the default) or background")]
pub struct QosParseError(pub String);

impl FromStr for QosClass {
    type Err = QosParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let name = s.trim().to_ascii_lowercase();
        Self::ALL.into_iter().find(|c| c.as_str() == name).ok_or_else(|| QosParseError(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_say_what_is_accepted() {
        for class in QosClass::ALL {
            assert_eq!(class.as_str().parse::<QosClass>().unwrap(), class);
            assert_eq!(QosClass::from_u8(class as u8), Some(class));
        }
        assert_eq!(" Latency ".parse::<QosClass>().unwrap(), QosClass::Latency);
        let err = "fast".parse::<QosClass>().unwrap_err().to_string();
        assert!(err.contains("\"fast\"") && err.contains("latency, throughput"), "{err}");
        assert_eq!(QosClass::from_u8(3), None);
        assert_eq!(QosClass::default(), QosClass::Throughput);
    }
}
