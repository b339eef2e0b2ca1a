//! Local infrastructure for `bagstore dev` and the test harness.

pub mod mariadb;
pub mod postgres;
mod supervise;
