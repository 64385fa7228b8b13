//! Short-circuit reads for clients on the same host: `OpenBlock` on the Unix socket answers a
//! [`strata_common::frame::BlockGrant`] with a file descriptor the client maps.
//! (Being built: until then the grant is refused and clients read the ordinary way.)

use std::sync::Arc;

use strata_common::ErrorKind;
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

use crate::blockstore::BlockStore;
use crate::dataplane::{GrantStream, reject, send_error};

impl GrantStream for UnixStream {
    async fn open_block(&mut self, _store: &Arc<BlockStore>, body_len: usize) -> std::io::Result<()> {
        let mut body = vec![0u8; body_len];
        self.read_exact(&mut body).await?;
        send_error(self, 0, ErrorKind::Unavailable, "short-circuit reads are not served here").await
    }

    async fn release(&mut self, _store: &Arc<BlockStore>, body_len: usize) -> std::io::Result<()> {
        let mut body = vec![0u8; body_len];
        self.read_exact(&mut body).await.map(drop)
    }

    async fn remote_read(&mut self, _store: &Arc<BlockStore>, _body_len: usize) -> std::io::Result<()> {
        reject(self, "RemoteRead is served on TCP only").await
    }
}
