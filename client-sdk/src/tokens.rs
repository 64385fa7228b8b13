//! Tokens, as an admin manages them (`strata token create|ls|revoke`). Thin wrappers over the
//! master's RPCs, which check the caller is an admin and the role and scope are valid.

use strata_proto::{CreateTokenRequest, Empty, RevokeTokenRequest, TokenInfo};

use crate::{AdminClient, Result};

impl AdminClient {
    /// A new token of `role` (`admin`, `writer`, `reader`, `worker`), limited to the subtree at
    /// `prefix` when not empty (readers and writers only): its description and the token,
    /// which the master does not keep.
    pub async fn create_token(&self, role: &str, prefix: &str, name: &str) -> Result<(TokenInfo, String)> {
        let req =
            CreateTokenRequest { role: role.to_string(), prefix: prefix.to_string(), name: name.to_string() };
        let answer =
            self.master().create_token(req).await.map_err(self.rpc_err("create_token"))?.into_inner();
        Ok((answer.info.unwrap_or_default(), answer.token))
    }

    /// Every token the master accepts (descriptions, never tokens).
    pub async fn list_tokens(&self) -> Result<Vec<TokenInfo>> {
        Ok(self
            .master()
            .list_tokens(Empty {})
            .await
            .map_err(self.rpc_err("list_tokens"))?
            .into_inner()
            .tokens)
    }

    /// Revokes the token with this id: refused by the master at once, by workers within a
    /// heartbeat.
    pub async fn revoke_token(&self, id: &str) -> Result<TokenInfo> {
        let req = RevokeTokenRequest { id: id.to_string() };
        Ok(self.master().revoke_token(req).await.map_err(self.rpc_err("revoke_token"))?.into_inner())
    }
}
