// tests/common/expect_error.h — asserts that a call throws gmoe::Error whose message contains
// every given fragment (the argument's name, what was expected, what was given).
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "gmoe/error.h"

#define GMOE_EXPECT_ERROR(statement, ...)                                                  \
  do {                                                                                     \
    bool gmoe_thrown_ = false;                                                             \
    try {                                                                                  \
      statement;                                                                           \
    } catch (const ::gmoe::Error& gmoe_err_) {                                             \
      gmoe_thrown_ = true;                                                                 \
      const std::string gmoe_msg_ = gmoe_err_.what();                                      \
      for (const char* gmoe_frag_ : std::initializer_list<const char*>{__VA_ARGS__}) {     \
        EXPECT_NE(gmoe_msg_.find(gmoe_frag_), std::string::npos)                           \
            << "message lacks \"" << gmoe_frag_ << "\": " << gmoe_msg_;                    \
      }                                                                                    \
    }                                                                                      \
    EXPECT_TRUE(gmoe_thrown_) << #statement " did not throw gmoe::Error";                  \
  } while (0)
