//! Who may do what in a Strata cluster, and how the bytes between its parts are protected.
//!
//! - [`token`]: bearer tokens (random, stored only as hashes), their roles and path scopes, and
//!   the check every control-plane call and data-plane connection goes through.
//! - [`tls`]: TLS on both planes from one configuration — PEM files read once into the tonic
//!   (gRPC) and rustls (data plane) configurations, with optional client certificates (mTLS).

pub mod tls;
pub mod token;
