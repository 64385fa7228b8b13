//! RDMA grants on the TCP data plane: `OpenBlock` answers a registered memory region that the
//! client reads one-sided. (Being built: until then the grant is refused.)

use std::sync::Arc;

use strata_common::ErrorKind;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::blockstore::BlockStore;
use crate::dataplane::{GrantStream, send_error};

impl GrantStream for TcpStream {
    async fn open_block(&mut self, _store: &Arc<BlockStore>, body_len: usize) -> std::io::Result<()> {
        let mut body = vec![0u8; body_len];
        self.read_exact(&mut body).await?;
        send_error(self, 0, ErrorKind::Unavailable, "RDMA grants are not served here").await
    }

    async fn release(&mut self, _store: &Arc<BlockStore>, body_len: usize) -> std::io::Result<()> {
        let mut body = vec![0u8; body_len];
        self.read_exact(&mut body).await.map(drop)
    }

    async fn remote_read(&mut self, _store: &Arc<BlockStore>, body_len: usize) -> std::io::Result<()> {
        let mut body = vec![0u8; body_len];
        self.read_exact(&mut body).await?;
        send_error(self, 0, ErrorKind::Unavailable, "RDMA emulation is off").await
    }
}
