//! The link to the master (or to the leader of HA masters): one gRPC client, and the outage
//! state every call moves. Every layer that asks the master ([`crate::view`], the metadata,
//! the admin calls) asks through this, so an outage is noticed and ended in one place.

use std::future::Future;

use strata_common::SharedClock;
use strata_proto::leader::LeaderChannel;
use strata_proto::master_client::MasterClient;

use crate::outage::{FALLBACK_DEADLINE, Outage};
use crate::{ClientConfig, ClientError, Result};

pub(crate) struct MasterLink {
    client: MasterClient<LeaderChannel>,
    outage: Outage,
    /// As configured (a comma-separated list for HA masters), for error messages.
    addr: String,
    clock: SharedClock,
}

impl MasterLink {
    pub(crate) fn new(channel: LeaderChannel, config: &ClientConfig) -> Self {
        Self {
            client: MasterClient::new(channel)
                .max_decoding_message_size(strata_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(strata_proto::MAX_MESSAGE_BYTES),
            outage: Outage::new(config.master_outage_grace, config.membership_refresh, &config.master_addr),
            addr: config.master_addr.clone(),
            clock: config.clock.clone(),
        }
    }

    /// The gRPC client (a cheap clone sharing the channel).
    pub(crate) fn client(&self) -> MasterClient<LeaderChannel> {
        self.client.clone()
    }

    pub(crate) fn outage(&self) -> &Outage {
        &self.outage
    }

    /// How a failed call of `rpc` becomes an error: with its kind, and naming the call when it
    /// was refused for its size.
    pub(crate) fn rpc_err(&self, rpc: &'static str) -> impl Fn(tonic::Status) -> ClientError + '_ {
        move |status| ClientError::from_status(rpc, status, &self.addr)
    }

    /// A call whose caller has nothing to fall back on: its answer, or its error with its kind.
    pub(crate) async fn ask<T>(
        &self,
        rpc: &'static str,
        call: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        call.await.map(tonic::Response::into_inner).map_err(self.rpc_err(rpc))
    }

    /// A call that moves the outage state. With `fallback` (the caller can answer without the
    /// master) it is skipped during an outage unless a probe is due, and bounded by
    /// [`FALLBACK_DEADLINE`]; either way it fails as `MasterUnavailable`.
    pub(crate) async fn call<T>(
        &self,
        rpc: &'static str,
        fallback: bool,
        call: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        let clock = &self.clock;
        let master = &self.addr;
        if fallback && !self.outage.should_ask(clock.now()) {
            return Err(ClientError::MasterUnavailable(format!(
                "master at {master} is unreachable (asked again in a moment)"
            )));
        }
        // An outage begins when the call that found it was made, not when it gave up.
        let (asked, asked_wall) = (clock.now(), clock.wall_ms());
        let answer = if fallback {
            match tokio::time::timeout(FALLBACK_DEADLINE, call).await {
                Ok(answer) => answer.map_err(self.rpc_err(rpc)),
                Err(_) => Err(ClientError::MasterUnavailable(format!(
                    "master at {master}: no answer to {rpc} within {} s",
                    FALLBACK_DEADLINE.as_secs()
                ))),
            }
        } else {
            call.await.map_err(self.rpc_err(rpc))
        };
        match &answer {
            Err(e) if e.is_master_outage() => self.outage.failed(asked, asked_wall, clock.now(), e),
            // Any answer, even a refusal, is the master being there.
            _ => self.outage.recovered(clock.now()),
        }
        answer.map(tonic::Response::into_inner)
    }
}
