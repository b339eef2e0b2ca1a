//! Values that must never be printed: bearer tokens, DSN passwords,
//! secret librdkafka options.

use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

/// A bearer token. It never appears in Debug output or logs.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl Secret {
    /// Compares without stopping at the first differing byte.
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

pub(super) fn secrets_list_or_csv<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Secret>, D::Error> {
    Ok(list_or_csv(d)?.into_iter().map(|dsn| Secret(dsn.0)).collect())
}

/// A MySQL connection URL. Its password never appears in Debug or Display.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Dsn(pub String);

impl Dsn {
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`: the one in the user
    /// info, and the value of any query parameter that names a password
    /// (sqlx ignores those, but DSNs copied from other drivers carry them).
    /// TLS parameters (`ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`) are paths
    /// and modes, not secrets, and stay readable.
    pub fn redacted(&self) -> String {
        let s = &self.0;
        let Some(scheme_end) = s.find("://").map(|i| i + 3) else { return s.clone() };
        // The authority ends at the first '/', '?' or '#'. The user info is
        // everything before its *last* '@', so an unescaped '@' inside a
        // password does not leave the password's tail visible.
        let authority_end = s[scheme_end..].find(['/', '?', '#']).map_or(s.len(), |i| scheme_end + i);
        let authority = &s[scheme_end..authority_end];
        let mut out = String::with_capacity(s.len());
        out.push_str(&s[..scheme_end]);
        match authority.rfind('@') {
            Some(at) => {
                let user_info = &authority[..at];
                match user_info.split_once(':') {
                    Some((user, _password)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str(user_info),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        let rest = &s[authority_end..];
        let (path, query) = match rest.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (rest, None),
        };
        out.push_str(path);
        if let Some(query) = query {
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if names_a_password(key) => format!("{key}=***"),
                    _ => pair.to_string(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
        out
    }
}

/// `password`, `pwd`, `passwd`, and spellings like `db-password`.
fn names_a_password(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password") || key.contains("passwd") || key == "pwd" || key.contains("secret")
}

impl fmt::Debug for Dsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Dsn({})", self.redacted())
    }
}

impl fmt::Display for Dsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Whether a librdkafka property holds a secret, so its value must never be
/// printed: the properties librdkafka itself marks sensitive (and redacts in
/// its own `debug=conf` dump), plus anything whose name looks like a
/// password, secret, token, credential or private key, including common
/// misspellings (`ssl.key.pasword`), since a typo is still the secret.
pub fn is_secret_kafka_option(key: &str) -> bool {
    const SENSITIVE: &[&str] = &[
        "ssl.key.location",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl_key",
        "ssl.ca.pem",
        "ssl.keystore.password",
        "sasl.username",
        "sasl.password",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.assertion.private.key.file",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.jaas.config",
    ];
    let key = key.trim().to_ascii_lowercase();
    SENSITIVE.contains(&key.as_str())
        || ["pass", "pasw", "pwd", "secret", "token", "credential", "private", "jaas"]
            .iter()
            .any(|word| key.contains(word))
}

/// A list, or one comma-separated string (from the environment).
pub(super) fn list_or_csv<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Dsn>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        List(Vec<String>),
        Csv(String),
    }
    Ok(match Either::deserialize(d)? {
        Either::List(v) => v.into_iter().map(Dsn).collect(),
        Either::Csv(s) => {
            s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(|s| Dsn(s.to_string())).collect()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::tests::{env, EXAMPLE};
    use crate::settings::Settings;

    #[test]
    fn tokens_never_show_in_debug_output_and_compare_exactly() {
        let s = Settings::from_toml_and_env(
            "[auth]\nwrite_tokens = [\"sekrit\"]",
            env(&[("BAGSTORE_AUTH__READ_TOKENS", "r1,r2")]),
        )
        .unwrap();
        assert!(!format!("{s:?}").contains("sekrit"));
        assert_eq!(s.auth.read_tokens.len(), 2);
        assert!(s.auth.write_tokens[0].matches("sekrit"));
        assert!(!s.auth.write_tokens[0].matches("sekri"));
        assert!(!s.auth.write_tokens[0].matches("sekriT"));
    }

    #[test]
    fn passwords_never_show_in_debug_output() {
        let s = Settings::from_toml_and_env(EXAMPLE, env(&[])).unwrap();
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("root:***@127.0.0.1:3308"));
    }

    #[test]
    fn dsn_redaction_keeps_tls_parameters_and_hides_every_password() {
        let cases = [
            (
                "mysql://app:hunter2@db:3306/bagstore?ssl-mode=VERIFY_CA&ssl-ca=/etc/ca.pem",
                "mysql://app:***@db:3306/bagstore?ssl-mode=VERIFY_CA&ssl-ca=/etc/ca.pem",
            ),
            // No database: the query string follows the authority directly.
            ("mysql://app:hunter2@db?ssl-mode=REQUIRED", "mysql://app:***@db?ssl-mode=REQUIRED"),
            // An '@' in the query is not user info.
            ("mysql://db:3306?ssl-ca=/certs/a@b.pem", "mysql://db:3306?ssl-ca=/certs/a@b.pem"),
            ("mysql://db:3306/x?ssl-key=/k@hunter2", "mysql://db:3306/x?ssl-key=/k@hunter2"),
            // An unescaped '@' inside the password.
            ("mysql://app:hun@ter2@db/x", "mysql://app:***@db/x"),
            // A password passed the way other drivers take it.
            (
                "mysql://app@db/x?password=hunter2&ssl-mode=REQUIRED",
                "mysql://app@db/x?password=***&ssl-mode=REQUIRED",
            ),
            ("mysql://root@127.0.0.1:3307/bagstore", "mysql://root@127.0.0.1:3307/bagstore"),
            ("not a url", "not a url"),
        ];
        for (dsn, want) in cases {
            let dsn = Dsn(dsn.to_string());
            assert_eq!(dsn.redacted(), want);
            assert_eq!(format!("{dsn}"), want);
            assert_eq!(format!("{dsn:?}"), format!("Dsn({want})"));
        }
    }

    #[test]
    fn kafka_secrets_never_show_in_debug_output() {
        let s = Settings::from_toml_and_env(
            r#"
            [kafka]
            brokers = "kafka:9093"
            [kafka.options]
            "security.protocol" = "sasl_ssl"
            "ssl.ca.location" = "/etc/bagstore/ca.pem"
            "ssl.key.password" = "hunter2-key"
            "sasl.username" = "bagstore"
            "sasl.oauthbearer.client.secret" = "hunter2-oauth"
            "ssl.key.pasword" = "hunter2-typo"
            "#,
            env(&[
                ("BAGSTORE_KAFKA__OPTIONS__SASL.PASSWORD", "hunter2-sasl"),
                ("BAGSTORE_KAFKA__OPTIONS__SSL.KEYSTORE.PASSWORD", "hunter2-keystore"),
            ]),
        )
        .unwrap();
        assert_eq!(s.kafka.options["sasl.password"], "hunter2-sasl");
        assert_eq!(s.kafka.options["ssl.keystore.password"], "hunter2-keystore");
        for dbg in [format!("{s:?}"), format!("{:?}", s.kafka), format!("{:#?}", s)] {
            assert!(!dbg.contains("hunter2"), "{dbg}");
            assert!(dbg.contains(r#""security.protocol": "sasl_ssl""#), "{dbg}");
            assert!(dbg.contains(r#""ssl.ca.location": "/etc/bagstore/ca.pem""#), "{dbg}");
            assert!(dbg.contains(r#""sasl.password": "***""#), "{dbg}");
        }
    }
}
